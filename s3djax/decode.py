"""Autoregressive decoding as one jitted `lax.while_loop`, and the host runner that times and streams it.

`ARDecoder` is a frozen dataclass of static settings (gemma's sampler pattern): `start` prefills a
padded prompt bucket and picks the first token; `decode` runs the loop on device until EOS, the
cache fills, or `stop_at` tokens exist. `stop_at` is traced, so streaming in chunks and any
--max-new-tokens reuse one executable per (model, plan, dtype, cache length).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from s3djax import cache as kv
from s3djax import compile_options
from s3djax.config import ModelConfig
from s3djax.errors import UserError
from s3djax.model import Decoder
from s3djax.sampling import Sampling, sample
from s3djax.skip_plan import SkipPlan

MIN_BUCKET = 16
# A prompt is prefilled in chunks of this many tokens (the last one bucketed), so a long prompt's activations and
# attention scores stay bounded whatever its length, and a chat's new turn continues the cache it left.
PREFILL_CHUNK = 512
# Decoders are frozen, hashable values, so one executable per (decoder, step, argument types) serves every
# Runner in the process: building the same method again (another Runner, a Generator session, a benchmark
# round) neither traces nor compiles. Tracing a SmolLM2 step takes seconds even when XLA's persistent cache
# holds its compiled code.
_EXECUTABLES: collections.OrderedDict = collections.OrderedDict()
MAX_EXECUTABLES = 64


@dataclasses.dataclass(frozen=True)
class ARDecoder:
    config: ModelConfig
    max_cache_len: int
    eos_ids: tuple[int, ...]
    pad_id: int = 0
    plan: SkipPlan | None = None
    sampling: Sampling = Sampling()
    cache_dtype: str = "float32"
    # Extra cache and output slots past max_cache_len, for loops that write a whole block past the
    # committed length: a step never has to shrink near the end, and output past the cap is dropped.
    slack: int = 0

    @property
    def buffer_len(self) -> int:
        """Cache slots: the cap and the slack."""
        return self.max_cache_len + self.slack

    def for_rows(self, n: int) -> "ARDecoder":
        """The decoder for a batch of n rows: this one (`SpecDecoder.for_rows` drops its pause gate)."""
        return self

    def check_prompt(self, n: int) -> None:
        if n == 0:
            raise UserError("the prompt is empty")
        if n >= self.max_cache_len:
            raise UserError(f"the prompt has {n} tokens but the cache holds {self.max_cache_len}; "
                            "raise --max-cache-len or shorten the prompt")

    def _step(self, params, tokens, positions, cache, slots, mask):
        return Decoder(self.config, self.plan).apply({"params": params}, tokens, positions, cache, slots, mask)

    def _logits(self, params, hidden):
        return Decoder(self.config).apply({"params": params}, hidden, method="logits")

    def empty(self, params, batch: int) -> dict:
        """What a prefill carries from one chunk of prompt to the next: an empty cache."""
        bits = self.config.cpu_kernel and jax.default_backend() == "cpu"  # see cache.BITS
        return {"cache": kv.init_cache(self.config, batch, self.buffer_len, self.cache_dtype, bits=bits)}

    def resume(self, state) -> dict:
        """The carry of a finished decode state (its cache), for a prefill that continues its text (a chat's turn)."""
        return {"cache": state["cache"]}

    def prefill(self, params, carry, tokens, start, count):
        """One chunk of prompt, tokens [B, C] at slots start [B], count [B] of them real: (the carry with their K/V,
        the last real token's final-normed hidden state [B, D])."""
        c = tokens.shape[1]
        positions = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None]
        hidden, cache = self._step(params, tokens, positions, carry["cache"], start, kv.prompt_chunk(start, c))
        return {**carry, "cache": cache}, last_real(hidden, count)

    def begin(self, params, carry, hidden, lengths, key):
        """The decode state after a prefill: each row's first token sampled from `hidden`, lengths [B] committed."""
        b = hidden.shape[0]
        key, sub = jax.random.split(key)
        first = sample(self._logits(params, hidden), sub, self.sampling)
        out = jnp.full((b, self.buffer_len), self.pad_id, jnp.int32).at[:, 0].set(first)
        return dict(tokens=out, cache=carry["cache"], step=jnp.int32(1), last=first, length=lengths.astype(jnp.int32),
                    done=self.is_eos(first), key=key)

    def start(self, params, prompt, lengths, key):
        """Prefill right-padded prompts [B, P] (real lengths [B]) as one chunk and sample each row's first token."""
        zeros = jnp.zeros_like(lengths, jnp.int32)
        carry, hidden = self.prefill(params, self.empty(params, prompt.shape[0]), prompt, zeros, lengths)
        return self.begin(params, carry, hidden, lengths, key)

    def is_eos(self, tokens):
        return jnp.isin(tokens, jnp.asarray(self.eos_ids or (-1,), jnp.int32))

    def decode(self, params, state, stop_at):
        """Generate until every row hit EOS, the cache is full, or `stop_at` tokens exist (one for every row, or
        each row's own [B]: the rows step together, so until the most of them)."""

        def cond(s):
            return jnp.any(s["step"] < stop_at) & ~jnp.all(s["done"])

        return jax.lax.while_loop(cond, lambda s: {**s, **self.advance(params, s)}, state)

    def advance(self, params, s):
        """One token per row: the state's tokens, cache, step, last, length, done and key after one forward."""
        slots = s["length"]
        hidden, cache = self._step(params, s["last"][:, None], slots[:, None], s["cache"], slots, kv.causal(slots, 1))
        key, sub = jax.random.split(s["key"])
        nxt = sample(self._logits(params, hidden[:, 0]), sub, self.sampling)
        nxt = jnp.where(s["done"], self.pad_id, nxt)
        tokens = jax.lax.dynamic_update_slice_in_dim(s["tokens"], nxt[:, None], s["step"], axis=1)
        # A row ends at EOS or where its cache is full; the others of a batch go on.
        length = slots + ~s["done"]
        return dict(tokens=tokens, cache=cache, step=s["step"] + 1, last=nxt, length=length,
                    done=s["done"] | self.is_eos(nxt) | (length >= self.max_cache_len), key=key)


def last_real(hidden, count):
    """hidden [B, C, D] of a padded chunk: each row's last real token's [B, D] (count [B] real tokens)."""
    return jnp.take_along_axis(hidden, (count - 1)[:, None, None], axis=1)[:, 0]


def bucket(length: int, max_len: int) -> int:
    """Prefill width: the next power of two (at least MIN_BUCKET), capped at the cache length."""
    return min(max_len, max(MIN_BUCKET, 1 << (length - 1).bit_length()))


def signature(tree) -> tuple:
    """What an executable depends on in its arguments: their structure, shapes, dtypes and placement."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((a.shape, a.dtype, getattr(a, "weak_type", False), getattr(a, "sharding", None))
                          if hasattr(a, "shape") else a for a in leaves)


@dataclasses.dataclass
class Result:
    tokens: list[int]          # new tokens, EOS included if it was produced
    prompt_tokens: int
    compile_s: float
    ttft_s: float              # prefill and first token, compile excluded
    decode_s: float            # the loop after the first token
    stats: dict = dataclasses.field(default_factory=dict)  # method statistics (speculative: tau, alpha_k)
    state: dict | None = None  # the final decode state, cache included, where asked to keep it (a chat's next turn)

    @property
    def tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if len(self.tokens) > 1 and self.decode_s > 0 else 0.0


class Runner:
    """Host side: ahead-of-time compiles (so compile time is reported apart), runs, times, streams."""

    def __init__(self, decoder: ARDecoder, params):
        self.decoder, self.params = decoder, params
        self.overrides: dict = {}  # start-state entries set after the prefill (the pause gate's measured breakeven)

    def _compiled(self, name: str, fn, *args):
        options = compile_options.for_step(self.params)
        key = (getattr(fn, "__self__", self.decoder), name, signature((self.params, *args)),  # a batch's decoder
               tuple(sorted(options.items())))
        if key in _EXECUTABLES:
            _EXECUTABLES.move_to_end(key)
            return _EXECUTABLES[key], 0.0
        t = time.perf_counter()
        donate = (1,) if name in ("decode", "prefill") else ()  # the state or carry, cache included, is updated in place
        _EXECUTABLES[key] = jax.jit(fn, donate_argnums=donate).lower(self.params, *args).compile(options)
        if len(_EXECUTABLES) > MAX_EXECUTABLES:
            _EXECUTABLES.popitem(last=False)
        return _EXECUTABLES[key], time.perf_counter() - t

    def _chunks(self, ids: list[int], start: int) -> list[tuple]:
        """ids[start:] as prefill chunks at slots start..: (tokens [1, C], start [1], count [1]) each, the last one
        bucketed and never reaching past the cache's buffer (a write there would be clamped onto earlier slots)."""
        d, chunks = self.decoder, []
        for at in range(start, len(ids), PREFILL_CHUNK):
            piece = ids[at:at + PREFILL_CHUNK]
            width = min(len(piece) if len(piece) == PREFILL_CHUNK else bucket(len(piece), PREFILL_CHUNK),
                        d.buffer_len - at)
            tokens = np.full((1, width), d.pad_id, np.int32)
            tokens[0, :len(piece)] = piece
            chunks.append((jnp.asarray(tokens), jnp.asarray([at], jnp.int32), jnp.asarray([len(piece)], jnp.int32)))
        return chunks

    def _prefiller(self, prompt_ids: list[int], seed: int, prior: tuple[dict, int] | None = None):
        """(run() -> the decode state after `prompt_ids`, compile seconds): `prior` = (a finished state, n) continues
        that state's cache, whose first n slots hold prompt_ids[:n], from slot n on. Everything is compiled before
        `run` is called, so that timing it times the prefill alone."""
        d = self.decoder
        d.check_prompt(len(prompt_ids))
        start = 0 if prior is None else prior[1]
        if not 0 <= start < len(prompt_ids):
            raise ValueError(f"a continued prefill needs new tokens past the {start} already cached")
        chunks, key = self._chunks(prompt_ids, start), jax.random.key(seed)
        lengths = jnp.asarray([len(prompt_ids)], jnp.int32)
        if prior is None and len(chunks) == 1:  # one executable for a short prompt on an empty cache (the common case)
            tokens = chunks[0][0]
            whole, compile_s = self._compiled("start", d.start, tokens, lengths, key)
            return lambda: whole(self.params, tokens, lengths, key), compile_s
        if prior is None:
            empty, compile_s = self._compiled("empty", lambda params: d.empty(params, 1))
            carry = empty.out_info
        else:
            empty, compile_s, carry = None, 0.0, jax.eval_shape(d.resume, prior[0])
        steps = []
        for chunk in chunks:  # each chunk's carry and hidden shapes come from the executable before it
            step, c = self._compiled("prefill", d.prefill, carry, *chunk)
            carry, hidden = step.out_info
            steps.append(step)
            compile_s += c
        begin, c = self._compiled("begin", d.begin, carry, hidden, lengths, key)

        def run():
            carry = empty(self.params) if prior is None else d.resume(prior[0])
            for step, chunk in zip(steps, chunks):
                carry, hidden = step(self.params, carry, *chunk)
            return begin(self.params, carry, hidden, lengths, key)
        return run, compile_s + c

    def prefill(self, prompt_ids: list[int], seed: int = 0, rows: int = 1):
        """The decode state right after the prompt (for profiling steps on a real cache), in `rows` rows."""
        state = self._prefiller(prompt_ids, seed)[0]()
        return stack_rows([state] * rows, row_axes(self.decoder.for_rows(rows), self.params) if rows > 1 else None)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0,
                 on_tokens: Callable[[list[int]], None] | None = None, chunk: int = 16,
                 prior: tuple[dict, int] | None = None, keep: bool = False) -> Result:
        """Generate for one prompt; `on_tokens(all_new_tokens_so_far)` is called after each chunk. `prior` and `keep`:
        see `iterate`."""
        steps = self.iterate(prompt_ids, max_new_tokens, seed, chunk if on_tokens else None, prior, keep)
        while True:
            try:
                tokens = next(steps)
            except StopIteration as finished:
                return finished.value
            on_tokens(tokens)

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int, seed: int = 0) -> list[Result]:
        """Generate for several prompts as one batch: a row per prompt in every decode step, each row stopping at its
        own EOS or cache end. Each prompt is prefilled alone, as `generate` prefills it, so a greedy row is what
        `generate` gives for its prompt. The rows share the decode time; row i's prefill draws with seed + i."""
        steps = self._run(prompts, max_new_tokens, seed, None)
        while True:
            try:
                next(steps)
            except StopIteration as finished:
                return finished.value

    def iterate(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0, chunk: int | None = 16,
                prior: tuple[dict, int] | None = None, keep: bool = False) -> Iterator[list[int]]:
        """Yields all new tokens so far after the first and after each `chunk` decode steps, and returns
        the Result; chunk None decodes in one call and yields nothing (no host sync between steps).
        prior = (a kept Result's state, n): continue that cache, whose first n slots hold prompt_ids[:n] (a chat's
        next turn prefills only the rest); keep: the Result keeps its final state for that."""
        steps = self._run([prompt_ids], max_new_tokens, seed, chunk, prior, keep)
        while True:
            try:
                rows = next(steps)
            except StopIteration as finished:
                return finished.value[0]
            yield rows[0]

    def _run(self, prompts: list[list[int]], max_new_tokens: int, seed: int, chunk: int | None,
             prior: tuple[dict, int] | None = None, keep: bool = False):
        d = self.decoder.for_rows(len(prompts))
        budgets = [min(max_new_tokens, d.max_cache_len - len(ids)) for ids in prompts]
        starts = [self._prefiller(ids, seed + i, prior) for i, ids in enumerate(prompts)]  # compiled before the clock
        compile_s = sum(c for _, c in starts)
        axes = row_axes(d, self.params) if len(prompts) > 1 else None
        t = time.perf_counter()
        state = stack_rows([run() for run, _ in starts], axes)
        state = {**state, **{k: jnp.asarray(v) for k, v in self.overrides.items()}}  # fresh: the loop donates them
        eos = set(getattr(d, "ar", d).eos_ids)

        def new(step):  # each row's tokens so far: its budget's worth, up to its EOS (later slots are padding)
            rows = [row[:min(step, b)] for row, b in zip(np.asarray(state["tokens"]).tolist(), budgets)]
            return [row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in rows]
        first = new(1)
        ttft = time.perf_counter() - t
        if chunk:
            yield first
        # A batch stops each row at its own budget (a speculative batch's rows commit at their own pace).
        def stop_at(n):
            return jnp.asarray(np.minimum(budgets, n), jnp.int32) if len(prompts) > 1 else jnp.int32(n)
        decode, c = self._compiled("decode", d.decode, state, stop_at(0))
        compile_s += c
        t = time.perf_counter()
        step, done, most = 1, bool(np.asarray(state["done"]).all()), max(budgets)
        while step < most and not done:
            state = decode(self.params, state, stop_at(min(most, step + chunk) if chunk else most))
            new_step = int(state["step"])
            done = bool(np.asarray(state["done"]).all()) or new_step == step
            step = new_step
            if chunk:
                yield new(step)
        decode_s = time.perf_counter() - t
        # A speculative step may emit past the budget; the extra tokens are dropped.
        stats = [d.stats(state, i) if hasattr(d, "stats") else {} for i in range(len(prompts))]
        return [Result(tokens=tokens, prompt_tokens=len(ids), compile_s=compile_s, ttft_s=ttft, decode_s=decode_s,
                       stats=st, state=state if keep else None) for tokens, ids, st in zip(new(step), prompts, stats)]


def row_axes(decoder, params) -> dict:
    """Which leaves of `decoder`'s decode state have a row axis (leading): those whose shape differs between a state
    of one row and one of two."""
    config = getattr(decoder, "ar", decoder).config

    def state(b):
        hidden, lengths = jnp.zeros((b, config.hidden_size), jnp.float32), jnp.ones((b,), jnp.int32)
        return jax.eval_shape(lambda p: decoder.begin(p, decoder.empty(p, b), hidden, lengths, jax.random.key(0)),
                              params)
    return jax.tree.map(lambda one, two: one.shape != two.shape, state(1), state(2))


def stack_rows(states: list[dict], axes: dict | None) -> dict:
    """One batch state from one-row states: the leaves with a row axis (`row_axes`) are joined on it; the step
    counter, the key and the rest are the first row's."""
    if len(states) == 1:
        return states[0]
    return jax.tree.map(lambda rows, *a: jnp.concatenate(a, 0) if rows else a[0], axes, *states)
