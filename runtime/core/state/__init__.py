"""Per-request recurrent state of hybrid models: the pool of state slots the scheduler hands out."""
