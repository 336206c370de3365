"""The scheduler's parts: its state and config, planning a step (`plan_step`) and assembling its
output (`assemble_output`), applying the runner's output (`apply_output`), stop checks, encoder
scheduling and the state invariants. The public API is `runtime.core.scheduler`."""
