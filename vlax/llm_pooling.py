"""`LLM.embed`, `classify`, `score` and `encode`: pooling requests with vLLM's call shapes.

Each call validates its whole batch first (a bad prompt or parameter anywhere raises an error
naming it, and nothing of the batch runs), then runs it and returns one output per input, in
input order, with a progress bar.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from runtime.core.request import PoolingParams
from runtime.multimodal.image_processor import PreprocessMemo
from runtime.multimodal.image_prompt import is_multi_vector
from runtime.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from runtime.runner_choice import pooling_on_generate

# What each API asks a model for, and the head it needs when the model lacks the task.
_NEEDS = {
    "embed": "an embedding model (no classification head)",
    "token_embed": "an embedding model (no classification head)",
    "classify": "a classification head (*ForSequenceClassification, num_labels)",
}


def run_pooling(
    llm,
    prompts,
    task: str,
    api: str,
    pooling_params,
    truncate_prompt_tokens: int | None,
    use_tqdm: bool,
    *,
    pairs: Sequence[tuple[str, str]] | None = None,
) -> list[PoolingRequestOutput]:
    """Run `prompts` (or cross-encoder `pairs` of texts) as pooling requests of `task`."""
    engine = llm.engine
    if not engine.pooling:
        raise ValueError(pooling_on_generate(engine.model_config, api))
    pooling = engine.pooling_input
    if task not in pooling.tasks:
        config = engine.model_config
        raise ValueError(
            f"LLM.{api}() needs {_NEEDS[task]}, but {config.path} ({config.architecture}) "
            f"serves the pooling tasks {list(pooling.tasks)}"
        )
    items = pairs if pairs is not None else _prompt_list(prompts)
    params_list = _per_prompt(pooling_params, len(items))
    batch = []
    memo = PreprocessMemo()  # a picture given in many prompts is preprocessed once
    for item, params in zip(items, params_list, strict=True):
        if truncate_prompt_tokens is not None:
            params = replace(
                params or PoolingParams(), truncate_prompt_tokens=truncate_prompt_tokens
            )
        params = pooling.resolve(params, task)
        images = None
        if pairs is None and (pooling.image_spec is not None or _has_images(item)):
            text, images = pooling.image_prompt(item, params, f"prompt {len(batch)}", memo)
            ids = images.token_ids
        elif pairs is None:
            text, ids = pooling.prompt_ids(item, params)
        else:
            first, second = item
            ids, start = pooling.encode(first, second, max_length=pooling.truncation(params))
            text, params = None, replace(params, token_type_start=start)
        request_id = str(next(llm._ids))
        batch.append(
            engine.process_pooling_request(request_id, ids, params, prompt=text, images=images)
        )
    order = [p.request_id for p in batch]
    if pooling.whole_prompts:
        # Prompts of like lengths share steps (a bidirectional step pads attention to its
        # longest prompt), as sentence-transformers sorts its batches; outputs keep input order.
        batch = sorted(batch, key=lambda p: len(p.prompt_token_ids))
    engine.add_processed(batch)
    return list(llm._in_order(order, use_tqdm))


def _has_images(item) -> bool:
    return isinstance(item, Mapping) and "multi_modal_data" in item


def _embed_task(llm) -> str:
    """A late-interaction retriever (ColPali) embeds every token: its embedding is
    [tokens, dim]; other embedders pool one vector."""
    return "token_embed" if is_multi_vector(llm.engine.model_config.architecture) else "embed"


def embed(llm, prompts, pooling_params, truncate_prompt_tokens, use_tqdm):
    task = _embed_task(llm)
    outs = run_pooling(
        llm, prompts, task, "embed", pooling_params, truncate_prompt_tokens, use_tqdm
    )
    if task == "token_embed":
        # Multi-vector: each input's embedding is a float32 [tokens, dim] array.
        return [
            EmbeddingRequestOutput(o.request_id, EmbeddingOutput(_data(o)), o.prompt_token_ids)
            for o in outs
        ]
    return [EmbeddingRequestOutput.from_base(o) for o in outs]


def classify(llm, prompts, pooling_params, truncate_prompt_tokens, use_tqdm):
    outs = run_pooling(
        llm, prompts, "classify", "classify", pooling_params, truncate_prompt_tokens, use_tqdm
    )
    return [ClassificationRequestOutput.from_base(o) for o in outs]


def score(llm, data_1, data_2, pooling_params, truncate_prompt_tokens, use_tqdm):
    """vLLM's LLM.score: pairs 1:1, 1:N or N:N. A cross-encoder (a one-label classification
    head) scores each pair as one prompt with token types; an embedding model scores by the
    cosine similarity of the two texts' embeddings."""
    firsts, seconds = _score_inputs(data_1, data_2)
    engine = llm.engine
    if not engine.pooling:
        raise ValueError(pooling_on_generate(engine.model_config, "score"))
    config = engine.model_config
    if config.num_labels is not None:
        if config.num_labels != 1:
            raise ValueError(
                f"LLM.score() needs a cross-encoder with one label, but {config.path} "
                f"({config.architecture}) has num_labels={config.num_labels}; use LLM.classify()"
            )
        for text in (*firsts, *seconds):
            if not isinstance(text, str):
                raise TypeError(
                    f"a cross-encoder scores pairs of texts (str), tokenized together; got {text!r}"
                )
        outs = run_pooling(
            llm,
            None,
            "score",
            "score",
            pooling_params,
            truncate_prompt_tokens,
            use_tqdm,
            pairs=list(zip(firsts, seconds, strict=True)),
        )
        return [
            ScoringRequestOutput(
                o.request_id, ScoringOutput(float(_data(o)[0])), o.prompt_token_ids
            )
            for o in outs
        ]
    if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
        raise TypeError("LLM.score() takes one PoolingParams for an embedding model")
    # 1:N embeds the one first prompt once.
    lefts = firsts[:1] if len(set(map(id, firsts))) == 1 else firsts
    task = _embed_task(llm)
    outs = run_pooling(
        llm, [*lefts, *seconds], task, "score", pooling_params, truncate_prompt_tokens, use_tqdm
    )
    left_outs, right_outs = outs[: len(lefts)], outs[len(lefts) :]
    if len(left_outs) == 1:
        left_outs = left_outs * len(right_outs)
    scores = []
    for left, right in zip(left_outs, right_outs, strict=True):
        u, v = _data(left), _data(right)
        if task == "token_embed":
            value = max_sim(u, v)
        else:
            value = float(u @ v / max(np.linalg.norm(u) * np.linalg.norm(v), 1e-12))
        scores.append(
            ScoringRequestOutput(
                f"{left.request_id}_{right.request_id}",
                ScoringOutput(value),
                left.prompt_token_ids + right.prompt_token_ids,
            )
        )
    return scores


def max_sim(query: np.ndarray, document: np.ndarray) -> float:
    """Late interaction (ColBERT / ColPali): each query token's best dot product over the
    document's tokens, summed over the query tokens (ColPaliProcessor.score_retrieval)."""
    sims = np.asarray(query, np.float32) @ np.asarray(document, np.float32).T
    return float(sims.max(axis=1).sum())


def _data(out: PoolingRequestOutput) -> np.ndarray:
    if out.outputs is None:
        raise RuntimeError(
            f"request {out.request_id!r} finished with {out.finish_reason!r} and no output"
            + (f": {out.error}" if out.error else "")
        )
    return out.outputs.data


def _score_inputs(data_1, data_2) -> tuple[list[str], list[str]]:
    firsts = [data_1] if isinstance(data_1, str | Mapping) else list(data_1)
    seconds = [data_2] if isinstance(data_2, str | Mapping) else list(data_2)
    if not firsts:
        raise ValueError("At least one text element must be given")
    if not seconds:
        raise ValueError("At least one text_pair element must be given")
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise ValueError(
            f"Input lengths must be either 1:1, 1:N or N:N (got {len(firsts)} and {len(seconds)})"
        )
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    return firsts, seconds


def _prompt_list(prompts) -> list:
    # No prompts: no outputs, as generate (and vLLM's pooling calls) answer.
    return [prompts] if isinstance(prompts, str | Mapping) else list(prompts)


def _per_prompt(pooling_params, n: int) -> list[PoolingParams | None]:
    if pooling_params is None or isinstance(pooling_params, PoolingParams):
        return [pooling_params] * n
    if isinstance(pooling_params, str | Mapping) or not hasattr(pooling_params, "__iter__"):
        raise TypeError(
            "pooling_params must be a PoolingParams or a list of them (one per prompt), got "
            f"{pooling_params!r}"
        )
    params = list(pooling_params)
    if len(params) != n:
        raise ValueError(
            f"got {len(params)} PoolingParams for {n} prompts; pass one, or one per prompt"
        )
    for i, p in enumerate(params):
        if not isinstance(p, PoolingParams):
            raise TypeError(f"pooling_params[{i}] must be a PoolingParams, got {p!r}")
    return params
