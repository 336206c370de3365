"""Test-wide settings: JAX on CPU, deterministic hypothesis profile for CI; shared fixtures."""

import logging
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_configure(config):
    """The tests' vlax cache (default checkpoint, JAX compiled programs) is a folder of their own,
    `$XDG_CACHE_HOME/vlax-tests` (else `~/.cache/vlax-tests`), not the user's `~/.cache/vlax`: a
    test run neither fills nor reads what the user's own runs compiled. Every checkout and clone
    on the machine shares it, as CI's runs do: a clone's first run at stop 28, with the cache
    inside the clone, compiled everything again (1,589 s against 537 s at stop 27). JAX keys each
    program by its HLO, options and version, so a shared entry is never another program's. The
    xdist workers inherit the controller's choice; a VLAX_CACHE_DIR set outside is kept (an empty
    one runs the suite cold).
    JAX's persistent compilation cache is turned on there for the whole run."""
    if not os.environ.get("VLAX_CACHE_DIR"):
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        os.environ["VLAX_CACHE_DIR"] = os.path.join(base, "vlax-tests")
    # On for every test, not only from the first `LLM` a worker builds: the kernel and model
    # tests build no `LLM`, so they compiled again on every run (about 600 s of the 1,638 s the
    # cold suite compiles in-process).
    from vlax import compilation_cache

    compilation_cache.enable()


class _LoggerMessages(logging.Handler):
    """Collects one logger's INFO and higher messages, on the logger itself (whatever the app's
    logging setup), as `records`; the logger's level is restored on exit."""

    def __init__(self, name: str):
        super().__init__(logging.INFO)
        self.logger, self.records = logging.getLogger(name), []

    def emit(self, record):
        self.records.append(record.getMessage())

    def __enter__(self):
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


@pytest.fixture(scope="session")
def logger_messages():
    """`with logger_messages("runtime.runner.model_runner") as log:` ... `log.records`.
    Session-scoped (it holds no state), so module-scoped fixtures can use it too."""
    return _LoggerMessages


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module. XLA:CPU maps each program's code
    into the process, and JAX keeps every program it compiled for the process's life: one
    xdist worker that ran half the suite reached 61,141 memory maps, against the kernel's
    vm.max_map_count of 65,530, and a worker past it aborts in the next compile or cache load
    (`Fatal Python error: Aborted` in deserialize_executable, which wedged a CI run). Modules
    share few programs, and those few come back from the persistent compilation cache."""
    yield
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
