"""The Python API: load a model once, then generate with any method, as many times as you like.

    gen = s3djax.Generator("smollm2-135m", method="s3d")
    out = gen.generate("Explain why the sky is blue.", max_new_tokens=128)
    print(out.text, out.tokens_per_s, out.tau, out.acceptance_by_depth)
    out = gen.generate("Tell me a story.", sampling=s3djax.Sampling(temperature=0.7, top_p=0.9), seed=1)

Every option is checked before a weight is read, with the command line's one-line `UserError`s.
Switching the method or its options reuses the loaded weights, and a method built once keeps its
compiled steps.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

from s3djax import defaults, device, methods, quant
from s3djax.built import Built
from s3djax.config import ATTENTION_IMPLS, default_attention
from s3djax.decode import Result, Runner
from s3djax.errors import UserError
from s3djax.loading import LoadedModel, ModelSource, open_model
from s3djax.registry import DEFAULT_MODEL
from s3djax.sampling import GREEDY, Sampling
from s3djax.speculative import gate
from s3djax.tokenizer import encode_chat, encode_prompt

OVERFLOWS = ("stop", "slide")  # what a chat does when its conversation outgrows the cache


@dataclasses.dataclass
class Output:
    """One completion and its statistics: those of `python -m infer.generate --json`.

    text and token_ids: the new tokens (the prompt excluded); prompt_tokens: the prompt's length
    after the chat template; tokens_per_s: new tokens after the first over decode time; ttft_s: time
    to the first new token; compile_s: compilation, measured apart; method, device, quant; param_bytes:
    target and draft weights; peak_device_bytes: the device's peak (None on a CPU); stats: the
    speculative methods' statistics (`tau`, `acceptance_by_depth`, verify_steps, ...).
    """
    text: str
    token_ids: list[int]
    prompt_tokens: int
    tokens_per_s: float
    ttft_s: float
    compile_s: float
    method: str
    device: str
    quant: str
    param_bytes: int
    peak_device_bytes: int | None
    stats: dict  # speculative methods: mean_accepted_tokens (tau), acceptance_by_depth, verify_steps, ...

    @property
    def tau(self) -> float | None:
        """Tokens per verify step, the bonus token included (speculative methods)."""
        return self.stats.get("mean_accepted_tokens")

    @property
    def acceptance_by_depth(self) -> list[float] | None:
        """alpha_k per draft depth k: the share of verify steps that accepted a depth-k draft among
        those that accepted depth k-1 (speculative methods)."""
        return self.stats.get("acceptance_by_depth")

    def json(self) -> dict:
        """Exactly the object `python -m infer.generate --json` prints."""
        return dict(text=self.text, prompt_tokens=self.prompt_tokens, new_tokens=len(self.token_ids),
                    tokens_per_s=round(self.tokens_per_s, 3), ttft_s=round(self.ttft_s, 4),
                    compile_s=round(self.compile_s, 3), device=self.device, method=self.method, quant=self.quant,
                    param_bytes=self.param_bytes, peak_device_bytes=self.peak_device_bytes, **self.stats)


@dataclasses.dataclass
class Session:
    """One method with its options and sampling, built on the loaded weights; its Runner keeps the
    compiled steps."""
    method: str
    built: Built
    runner: Runner

    @property
    def warnings(self) -> list[str]:
        """What the build warned about (an untrained draft, a target replaced by a full-mode draft)."""
        return self.built.warnings

    @property
    def about(self) -> str:
        """Which draft a speculative method uses, and where the pause gate is on its measured breakeven, as the stats
        line names them."""
        breakeven, free = self.runner.overrides.get("breakeven"), self.runner.overrides.get("breakeven_free")
        if breakeven is None:
            return self.built.draft
        where_free = "" if self.runner.decoder.drafter.free is None else f", {float(free):.2f}+ where lookup drafts"
        return (self.built.draft + f"; a step drafts while it expects {float(breakeven):.2f}+ drafts accepted"
                + where_free + " (the pause gate, measured here)")


class Stream:
    """Iterate for the text as it is decoded (whole UTF-8 characters only); `output` is set once
    the iteration ends. Made by `Generator.stream`:

        for piece in (stream := gen.stream("Tell me a story.", max_new_tokens=64)):
            print(piece, end="", flush=True)
        print(stream.output.tokens_per_s)
    """

    def __init__(self, gen: "Generator", session: Session, ids: list[int], steps: Iterator[list[int]],
                 on_done: Callable[[Result], None] | None = None):
        self._gen, self._session, self._ids, self._steps, self._on_done = gen, session, ids, steps, on_done
        self.output: Output | None = None

    def __iter__(self) -> Iterator[str]:
        tokenizer, printed = self._gen.tokenizer, 0
        while True:
            try:
                tokens = next(self._steps)
            except StopIteration as finished:
                if self._on_done:
                    self._on_done(finished.value)
                self.output = self._gen._output(self._session, finished.value)
                return
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # hold back an incomplete character
                yield text[printed:]
                printed = len(text)


class Generator:
    """A model loaded once, and the methods that decode with it.

    model: a registry name, a .gguf file or a Hugging Face checkpoint folder (`checkpoint` for a
    registry shape such as llama-2-7b). method and **options: the default method and its options
    (`s3djax.options.Options`, each field with its help); `generate` and `stream` may name others. quant: None keeps the weights as stored,
    "int8" or "int8-all" quantizes on load. load=False reads the weights on first use (`load`).
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, method: str = "ar", dtype: str = "float32",
                 max_cache_len: int = 2048, quant: str | None = None, matmul: str = "xla", attention: str | None = None,
                 checkpoint: str | None = None, load: bool = True, progress: bool | None = None, **options):
        from s3djax.loading import check_load_options

        check_load_options(dtype, quant, matmul)
        attention = attention or default_attention()
        if attention not in ATTENTION_IMPLS:
            raise UserError(f"unknown attention {attention!r}; choose from {', '.join(ATTENTION_IMPLS)}")
        if max_cache_len < 2:
            raise UserError(f"--max-cache-len must be at least 2, got {max_cache_len}")
        self.source = open_model(model, checkpoint)
        self.dtype, self.max_cache_len, self.quant, self.matmul, self.attention = (
            dtype, max_cache_len, quant, matmul, attention)
        self.method, self.options, self.progress = method, options, progress
        self.model: LoadedModel | None = None
        self._sessions: dict = {}  # key -> Session
        self._checked: dict = {}   # key -> the decoder of a build over abstract weights
        self.check()
        if load:
            self.load()

    @classmethod
    def from_model(cls, model: LoadedModel, *, method: str = "ar", dtype: str = "float32", max_cache_len: int = 2048,
                   **options) -> "Generator":
        """A Generator on weights already in memory (a random test model, weights changed in a notebook)."""
        gen = cls.__new__(cls)
        gen.source = ModelSource(model.name, "", None, model.config, None, _tokenizer=model.tokenizer)
        gen.dtype, gen.max_cache_len, gen.quant, gen.matmul, gen.attention = (
            dtype, max_cache_len, None if model.quant == "none" else model.quant, model.matmul, model.config.attention)
        gen.method, gen.options, gen.progress, gen.model, gen._sessions, gen._checked = (
            method, options, None, model, {}, {})
        gen.check()
        return gen

    @property
    def tokenizer(self):
        """The model's tokenizer (a transformers tokenizer), available before the weights are read."""
        return self.source.tokenizer

    @property
    def config(self):
        """The model's `ModelConfig` (layers, heads, sizes), read from its header."""
        return self.source.config

    def load(self) -> LoadedModel:
        """Read the weights (once)."""
        if self.model is None:
            self.model = self.source.load(dtype=self.dtype, attention=self.attention, quantization=self.quant,
                                          matmul=self.matmul, progress=self.progress)
        return self.model

    def check(self, prompt: str | None = None, *, method: str | None = None, chat_template: bool = True,
              sampling: Sampling = GREEDY, **options) -> list[int] | None:
        """Everything that can be checked without the weights: the method and its options (artifact
        files by their contents), the sampling, and whether the prompt fits the cache. Returns the
        prompt's token ids when given one."""
        key = self._key(method, sampling, options)
        if key not in self._checked:
            method, sampling, options = key[0], key[1], dict(key[2])
            self._checked[key] = methods.check(method, self.source, max_cache_len=self.max_cache_len,
                                               sampling=sampling, dtype=self.dtype, quantization=self.quant,
                                               matmul=self.matmul, **options).decoder
        if prompt is None:
            return None
        ids = encode_prompt(self.tokenizer, prompt, chat_template)
        self._checked[key].check_prompt(len(ids))
        return ids

    def _timing_text(self) -> list[int]:
        """The ids of the text this machine's step times are measured on (the pause gate's, a batch's)."""
        return gate.prompt_ids(self.tokenizer)

    def _key(self, method: str | None, sampling: Sampling, options: dict, defaults: bool = True) -> tuple:
        """What a built method depends on besides the weights."""
        return method or self.method, sampling, tuple(sorted({**(self.options if defaults else {}), **options}.items()))

    def session(self, method: str | None = None, *, sampling: Sampling = GREEDY, defaults: bool = True,
                **options) -> Session:
        """The method built on the loaded weights; built once per method, options and sampling. `defaults`: the
        Generator's own options apply where these do not say otherwise."""
        key = self._key(method, sampling, options, defaults)
        if key not in self._sessions:
            if self.model is None:  # bad options fail before the weights are read
                self.check(method=method, sampling=sampling, **options)
            method, sampling, options = key[0], key[1], dict(key[2])
            built = methods.build(method, self.load(), max_cache_len=self.max_cache_len, dtype=self.dtype,
                                  sampling=sampling, **options)
            runner = Runner(built.decoder, built.params)
            gate.tune(runner, self._timing_text, method, options.get("pause"))
            self._sessions[key] = Session(method, built, runner)
        return self._sessions[key]

    def generate(self, prompt: str | list[str], max_new_tokens: int = 128, *, method: str | None = None,
                 sampling: Sampling = GREEDY, seed: int = 0, chat_template: bool = True,
                 **options) -> Output | list[Output]:
        """The completion of one prompt, or of each prompt in a list, decoded as one batch: each row greedy-identical
        to its prompt alone, an Output's tokens_per_s its row's and stats["batch_tokens_per_s"] the whole batch's.
        A batch drafts, each row on its own cursor, where the speed model measured here predicts that faster than the
        target's own steps for the batch, else it takes those (`defaults.batch_choice`; stats["batch_drafting"] says
        which and why)."""
        if not isinstance(prompt, (list, tuple)):
            session, ids = self._start(prompt, max_new_tokens, method, chat_template, sampling, options)
            return self._output(session, session.runner.generate(ids, max_new_tokens, seed=seed))
        if not prompt:
            raise UserError("no prompts to generate for")
        if len(prompt) == 1:
            return [self.generate(prompt[0], max_new_tokens, method=method, seed=seed, chat_template=chat_template,
                                  sampling=sampling, **options)]
        self.check(method=method, sampling=sampling, **options)  # the method's options are still the user's to get right
        name, drafts, how = method or self.method, False, ""
        if name != "ar":
            spec = self.session(name, sampling=sampling, **options)
            drafts, how = defaults.batch_choice(name, spec.built.chosen, spec.runner,
                                                self.session("ar", sampling=sampling, defaults=False).runner,
                                                len(prompt), self._timing_text)
        plain = name != "ar" and not drafts  # then the target alone: no draft's skip plan
        starts = [self._start(p, max_new_tokens, name if drafts else "ar", chat_template, sampling,
                              {} if plain else options, defaults=not plain) for p in prompt]
        session, rows = starts[0][0], [ids for _, ids in starts]
        results = session.runner.generate_batch(rows, max_new_tokens, seed=seed)
        total = sum(max(len(r.tokens) - 1, 0) for r in results) / results[0].decode_s if results[0].decode_s else 0.0
        for r in results:
            r.stats = {**r.stats, "batch": len(results), "batch_tokens_per_s": total,
                       **({"batch_drafting": how} if how else {})}
        return [self._output(session, r) for r in results]

    def stream(self, prompt: str, max_new_tokens: int = 128, *, method: str | None = None, sampling: Sampling = GREEDY,
               seed: int = 0, chat_template: bool = True, chunk: int = 16, **options) -> Stream:
        """Like `generate`, but iterate the result for the text as it comes, `chunk` decode steps at a
        time; the Output is the stream's `output` once it ends."""
        session, ids = self._start(prompt, max_new_tokens, method, chat_template, sampling, options)
        return Stream(self, session, ids, session.runner.iterate(ids, max_new_tokens, seed, chunk))

    def chat(self, method: str | None = None, *, sampling: Sampling = GREEDY, system: str | None = None,
             overflow: str = "stop", **options) -> "Chat":
        """A conversation that keeps its cache between turns (`Chat`), decoded by one method."""
        if overflow not in OVERFLOWS:
            raise UserError(f"unknown overflow {overflow!r}; choose from {', '.join(OVERFLOWS)}")
        self.check(method=method, sampling=sampling, **options)
        return Chat(self, self.session(method, sampling=sampling, **options), system, overflow)

    def _start(self, prompt, max_new_tokens, method, chat_template, sampling, options, defaults: bool = True):
        if max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
        session = self.session(method, sampling=sampling, defaults=defaults, **options)
        ids = encode_prompt(self.tokenizer, prompt, chat_template)
        session.built.decoder.check_prompt(len(ids))
        return session, ids

    def _output(self, session: Session, result: Result) -> Output:
        return Output(text=self.tokenizer.decode(result.tokens, skip_special_tokens=True), token_ids=result.tokens,
                      prompt_tokens=result.prompt_tokens, tokens_per_s=result.tokens_per_s, ttft_s=result.ttft_s,
                      compile_s=result.compile_s, method=session.method, device=device.describe(),
                      quant=self.model.quant, param_bytes=quant.param_bytes(session.built.params),
                      peak_device_bytes=device.memory_bytes("peak_bytes_in_use"), stats=result.stats)


class Chat:
    """A conversation whose turns continue one KV cache, as llama.cpp's and Hugging Face's chats reuse theirs.

        chat = gen.chat(method="s3d", system="Answer briefly.")
        print(chat.send("Name a prime.").text)
        for piece in chat.stream("And the next one?"):
            print(piece, end="")

    Each turn renders the whole conversation with the chat template and prefills only the ids past the longest
    prefix its cache already holds (the new turn, and any of the last answer that the template renders otherwise),
    so greedy output is exactly that of the whole conversation decoded from scratch. When the conversation no
    longer fits the cache with room for the answer, overflow "stop" raises a one-line `UserError` (`reset`, or a
    larger max_cache_len, goes on), and "slide" drops the oldest exchanges until it fits, then prefills the rest
    anew. An answer that fills the cache stops there (its stats say so).
    """

    def __init__(self, gen: Generator, session: Session, system: str | None, overflow: str):
        self._gen, self.session, self.system, self.overflow = gen, session, system, overflow
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (its messages and cache)."""
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self._state, self._cached = None, []  # the last turn's final state, and the ids its cache's slots hold

    @property
    def cached_tokens(self) -> int:
        """Tokens of the conversation whose K/V the cache holds."""
        return len(self._cached)

    def send(self, text: str, max_new_tokens: int = 256, *, seed: int = 0) -> Output:
        """The answer to one more user message (the conversation keeps both)."""
        ids, prior, finish = self._turn(text, max_new_tokens)
        result = self.session.runner.generate(ids, max_new_tokens, seed, prior=prior, keep=True)
        finish(result)
        return self._gen._output(self.session, result)

    def stream(self, text: str, max_new_tokens: int = 256, *, seed: int = 0, chunk: int = 16) -> Stream:
        """`send`, iterated for the text as it comes (`Generator.stream`)."""
        ids, prior, finish = self._turn(text, max_new_tokens)
        steps = self.session.runner.iterate(ids, max_new_tokens, seed, chunk, prior, keep=True)
        return Stream(self._gen, self.session, ids, steps, on_done=finish)

    def _turn(self, text: str, max_new_tokens: int):
        if max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
        if not text.strip():
            raise UserError("the message is empty")
        messages = self.messages + [{"role": "user", "content": text}]
        ids = encode_chat(self._gen.tokenizer, messages)
        cap = self._gen.max_cache_len
        while len(ids) + max_new_tokens > cap and self.overflow == "slide" and self._exchanges(messages) > 1:
            messages = self._drop_oldest(messages)
            ids = encode_chat(self._gen.tokenizer, messages)
        if len(ids) >= cap or (len(ids) + max_new_tokens > cap and self.overflow == "stop"):
            raise UserError(f"the conversation has {len(ids)} tokens and the answer may take {max_new_tokens} more, "
                            f"but the cache holds {cap}: /reset, raise --max-cache-len, or --overflow slide")
        reuse = next((i for i, (a, b) in enumerate(zip(self._cached, ids)) if a != b), min(len(self._cached), len(ids)))
        reuse = min(reuse, len(ids) - 1)  # the last prompt token's forward gives the first answer token
        prior = (self._state, reuse) if self._state is not None and reuse > 0 else None
        self._state = None  # a continued prefill consumes the old cache in place

        def finish(result: Result) -> None:
            committed = int(result.state["length"][0])
            self._state, self._cached = result.state, (ids + result.tokens)[:min(committed, len(ids) + len(result.tokens) - 1)]
            result.state = None
            self.messages = messages + [{"role": "assistant", "content": self._gen.tokenizer.decode(
                result.tokens, skip_special_tokens=True)}]
            result.stats = {**result.stats, "reused_tokens": prior[1] if prior else 0,
                            "conversation_tokens": len(ids) + len(result.tokens),
                            "cache_full": committed >= cap}
        return ids, prior, finish

    @staticmethod
    def _exchanges(messages: list[dict]) -> int:
        return sum(m["role"] == "user" for m in messages)

    @staticmethod
    def _drop_oldest(messages: list[dict]) -> list[dict]:
        """Without the oldest user message and the answers up to the next one (a system message stays)."""
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        after = next(i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user")
        return messages[:first] + messages[after:]
