"""The trainer role: the actor interface every backend implements, the shared RL step
(`batch`, `metrics`), rank 0's weight publishing, the backends (`torch`, `megatron`) and
which one a job runs (`select`). Only `select` imports a backend; backends never import
each other."""
