"""The `rljob` command: `run`, `validate`, `crd`, `docs` (`main`), and `rljob run` itself."""
