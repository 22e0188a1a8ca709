"""What every trainer backend shares: the actor interface, the group of ranks the driver
drives, the rollout batch and its RL math, and rank 0's weight sync. Backends import this
package; it imports none of them."""
