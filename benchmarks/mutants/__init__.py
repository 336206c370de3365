"""The mutant catalogue, one module per area: core, runner (sampler and inputs), model, kernel
references. `benchmarks/mutation_pass.py` runs it."""

from benchmarks.mutants import core, kernels, model, runner
from benchmarks.mutants.mutant import Mutant

MUTANTS: tuple[Mutant, ...] = core.MUTANTS + runner.MUTANTS + model.MUTANTS + kernels.MUTANTS

__all__ = ["MUTANTS", "Mutant"]
