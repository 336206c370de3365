"""PoolingParams: what an embed, classify, score or encode request asks of a pooling model.

vLLM's PoolingParams, with its names, defaults and meanings:
- `truncate_prompt_tokens`: None, no truncation (a prompt longer than max_model_len is refused);
  k >= 1, keep k tokens (a text prompt is truncated by its tokenizer, which keeps its special
  tokens; a token-id prompt keeps its last k ids); -1, k = max_model_len.
- `dimensions` (embed, token_embed): keep the first d dimensions of the embedding (matryoshka
  models only), before normalization.
- `normalize` (embed, token_embed): L2-normalize the embedding; None takes the model's default.
- `use_activation` (classify, score): softmax over the labels (sigmoid for one label or a
  multi-label head, none for a regression head); None means True. `activation` is its name
  before vLLM 0.15, still accepted here. For embed and token_embed it is vLLM 0.33's name of the
  normalize switch (its PoolingParams has no `normalize`): given there, it sets `normalize`.

A value is made by the caller and resolved once for its task by `verify`, which fills the
defaults from the model and refuses what the task does not take, as vLLM's `verify` does.
"""

from dataclasses import dataclass, replace

__all__ = ["POOLING_TASKS", "TOKEN_TASKS", "PoolingParams"]

POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")
# Tasks that return one row per prompt token.
TOKEN_TASKS = ("token_embed", "token_classify")
# The parameters each task takes (vLLM's valid_parameters); the others must stay None.
_TASK_PARAMETERS = {
    "embed": ("dimensions", "normalize", "use_activation"),
    "token_embed": ("dimensions", "normalize", "use_activation"),
    "classify": ("use_activation",),
    "score": ("use_activation",),
    "token_classify": ("use_activation",),
}
_TASK_SPECIFIC = ("dimensions", "normalize", "use_activation")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(name: str, value: object, expected: str) -> ValueError:
    return ValueError(f"PoolingParams.{name}={value!r}: expected {expected}")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    # vLLM's name for use_activation before 0.15; given alone, it sets use_activation.
    activation: bool | None = None
    # Set by `verify`, never by a caller: the task these parameters were resolved for.
    task: str | None = None
    # Compute every prompt token even where the prefix cache holds it; `verify` sets it (True for
    # token tasks, which return every position; vLLM's rule).
    skip_reading_prefix_cache: bool | None = None
    # Set by the input processor for a cross-encoder pair: the position of the pair's second
    # text, from which tokens have token type 1 (vLLM's compressed_token_type_ids).
    token_type_start: int | None = None

    def __post_init__(self) -> None:
        trunc = self.truncate_prompt_tokens
        if trunc is not None and (not _is_int(trunc) or trunc == 0 or trunc < -1):
            raise _bad(
                "truncate_prompt_tokens",
                trunc,
                "an int >= 1 (keep that many tokens), -1 (keep max_model_len) or None",
            )
        dims = self.dimensions
        if dims is not None and (not _is_int(dims) or dims < 1):
            raise _bad("dimensions", dims, "an int >= 1 or None")
        for name in ("normalize", "use_activation", "activation", "skip_reading_prefix_cache"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise _bad(name, value, "a bool or None")
        if self.activation is not None:
            if self.use_activation is not None and self.use_activation != self.activation:
                raise _bad(
                    "activation",
                    self.activation,
                    f"the same as use_activation={self.use_activation} (activation is its old "
                    "name; give one of them)",
                )
            object.__setattr__(self, "use_activation", self.activation)
        if self.task is not None and self.task not in POOLING_TASKS:
            raise _bad("task", self.task, f"one of {POOLING_TASKS} or None")
        start = self.token_type_start
        if start is not None and (not _is_int(start) or start < 1):
            raise _bad("token_type_start", start, "an int >= 1 or None")

    def verify(
        self,
        task: str,
        *,
        model: str,
        default_normalize: bool = True,
        hidden_size: int | None = None,
        is_matryoshka: bool = False,
        matryoshka_dimensions: tuple[int, ...] | None = None,
    ) -> "PoolingParams":
        """These parameters resolved for `task` on a model (`model` names it in errors): the
        model's defaults filled in, and ValueError, with vLLM's message, for a parameter the
        task does not take or a dimension the model cannot give."""
        if task not in POOLING_TASKS:
            raise ValueError(f"unknown pooling task {task!r}; expected one of {POOLING_TASKS}")
        if self.task is not None and self.task != task:
            raise ValueError(f"You cannot overwrite self.task={self.task!r} with task={task!r}!")
        valid = _TASK_PARAMETERS[task]
        invalid = [k for k in _TASK_SPECIFIC if k not in valid and getattr(self, k) is not None]
        if invalid:
            raise ValueError(
                f"Task {task} only supports {list(valid)} parameters, does not support "
                f"{invalid} parameters"
            )
        changes: dict = {"task": task}
        if self.skip_reading_prefix_cache is None:
            changes["skip_reading_prefix_cache"] = task in TOKEN_TASKS
        if "normalize" in valid:
            normalize = self.normalize
            if self.use_activation is not None:  # vLLM 0.33's name for it on these tasks
                if normalize is not None and normalize != self.use_activation:
                    raise _bad(
                        "use_activation",
                        self.use_activation,
                        f"the same as normalize={normalize} (for {task} both name the "
                        "normalization; give one of them)",
                    )
                normalize = self.use_activation
            changes["normalize"] = default_normalize if normalize is None else normalize
            if self.dimensions is not None:
                _check_dimensions(
                    self.dimensions, model, hidden_size, is_matryoshka, matryoshka_dimensions
                )
        elif self.use_activation is None:
            changes["use_activation"] = True
        return replace(self, **changes)


def _check_dimensions(
    dimensions: int,
    model: str,
    hidden_size: int | None,
    is_matryoshka: bool,
    matryoshka_dimensions: tuple[int, ...] | None,
) -> None:
    if not is_matryoshka:
        raise ValueError(
            f'Model "{model}" does not support matryoshka representation, changing output '
            "dimensions will lead to poor results."
        )
    if matryoshka_dimensions:
        if dimensions not in matryoshka_dimensions:
            raise ValueError(
                f'Model "{model}" only supports {list(matryoshka_dimensions)} matryoshka '
                "dimensions, use other output dimensions will lead to poor results."
            )
    elif hidden_size is not None and dimensions > hidden_size:
        # vLLM would slice past the end and return the whole embedding; vlax says so instead.
        raise ValueError(
            f"PoolingParams.dimensions={dimensions}: model {model!r} has {hidden_size}-dimensional "
            f"embeddings; expected 1..{hidden_size}"
        )
