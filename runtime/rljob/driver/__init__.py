"""The driver process: one attempt of a job from start-up to exit code.

`run` is the entry (`run_job`); `attempt` holds what exists from the first moment (store,
Ray, reporter, signals) and reports failures and stops; `start` builds the `Job` (roles
placed, state resumed, weight sync joined); `loop` is the loop; `job` the parts of a step;
`report` what a step and a run tell the user; `outcome` how every way out becomes an exit
code; `state` and `checkpoints` what a checkpoint keeps of the loop; `stop` SIGTERM/SIGINT.
"""
