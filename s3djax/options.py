"""The speculative methods' options, declared once: `methods.build`'s and `Generator`'s keywords, the command line's
flags (`add_flags`, `from_args`) and their help all come from `Options`' fields. Where a default is not given here it
is chosen when the method is built: docs/defaults.md."""

from __future__ import annotations

import dataclasses
import itertools

from s3djax.errors import UserError


def _option(help: str, type=str, *, default=None, flag: str | None = None, aliases: tuple = (), choices=None):
    return dataclasses.field(default=default, metadata=dict(help=help, type=type, flag=flag, aliases=aliases,
                                                            choices=choices))


ARTIFACT = ("the method's trained artifact: s3d's draft (.npz), self-spec's searched plan (.yaml), kangaroo's adapter "
            "or s2d's nested draft (.npz); default: the model's shipped one; 'none': untrained (s3d's bare mask token, "
            "self-spec's default plan)")


@dataclasses.dataclass(frozen=True)
class Options:
    """Every method's choices; each method reads its own. None: the method's default."""
    skip: str = _option('layers to skip, e.g. "8-21" or "3.attn,5-7.mlp": the draft\'s plan for s3d (default: about '
                        "half, around the middle) and self-spec (default: its searched plan), the whole model's for ar "
                        "(default: none)", default="")
    gamma: int | None = _option("positions drafted per step (s3d; default: a named tree's depth, else chosen on this "
                                "machine by the speed model)", int)
    tree: str | None = _option("token tree: chain, topK (the chain plus the next K-1 candidates at each depth; default: "
                               "the one the draft's file records, else chain), dynamic-N (s3d: the N likeliest paths "
                               "by the draft's joint probabilities, chosen every step), or a name in configs/trees (s3d)")
    draft_path: str | None = _option(ARTIFACT, flag="--draft", aliases=("--skip-plan",))
    max_draft: int | None = _option("the deepest draft of self-spec, kangaroo, s2d and lookup (default: chosen on "
                                    "this machine by the speed model; where it cannot be, the one their file records, "
                                    "else the paper's, and lookup's from configs/defaults.yaml)", int)
    exit_layer: int | None = _option("kangaroo: the early-exit layer (default: the adapter's)", int)
    eta: float | None = _option("kangaroo: stop drafting at top-1 confidence <= eta (default: the adapter's, else the "
                                "paper's 0.6)", float)
    thresholds: str | None = _option("s2d: per-exit confidence thresholds a,b,c (default: the draft's for this target)")
    target_from: str | None = _option("s2d: verify with this full-mode s3d draft's fine-tuned layers")
    ngram: int | None = _option("lookup: the longest n-gram of the last tokens matched in the prompt and output (down "
                                "to 1; default 3)", int)
    lookup: int | None = _option("s3d, self-spec, kangaroo and s2d on a chain: draft a step's chain by prompt lookup "
                                 "instead, wherever the last N or more tokens occurred before (0: never; default: "
                                 "configs/defaults.yaml)", int)
    draft_weights: str | None = _option("s3d, self-spec, kangaroo and s2d: the weights their draft reads, none (the "
                                        "target's) or int8 (int8 copies of the layers it runs alone, its head rows and "
                                        "adapter; verification keeps the target's, so the output is the same); "
                                        "default: configs/defaults.yaml")
    kv_dtype: str | None = _option("the KV cache's dtype (every method): bfloat16 halves the bytes each step reads at a "
                                   "long context, as llama.cpp's default f16 cache does; greedy speculative output "
                                   "stays ar's at the same --kv-dtype (default: the weights' --dtype)",
                                   choices=("float32", "bfloat16"))
    pause: str | None = _option("every speculative method but s3d drafting in the verify pass: take the target's own "
                                "step while the drafts a step is expected to accept do not pay for drafting, by step "
                                "times measured once on this machine (default: configs/defaults.yaml; S3DJAX_TUNE=on, "
                                "off or again overrides)",
                                choices=("on", "off"))
    in_verify: str | None = _option("s3d on a chain: on drafts the next chain inside the verify pass, a draft block "
                                    "beside every drafted token, instead of in a draft step (default: "
                                    "configs/defaults.yaml)", choices=("on", "off"))

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def checked(cls, options: dict) -> "Options":
        unknown = set(options) - set(cls.names())
        if unknown:
            raise UserError(f"unknown method options {sorted(unknown)}; choose from {', '.join(cls.names())}")
        return cls(**options)


def flag(field: dataclasses.Field) -> str:
    return field.metadata["flag"] or "--" + field.name.replace("_", "-")


def add_flags(parser, several: bool = False) -> None:
    """Every option as a flag; `several`: one run builds several methods (infer.benchmark), so --draft takes
    METHOD=PATH pairs."""
    for f in dataclasses.fields(Options):
        m = f.metadata
        help = m["help"] + ("; with several methods, METHOD=PATH pairs separated by commas"
                            if several and f.name == "draft_path" else "")
        kwargs = dict(dest=f.name, help=help, default=f.default, choices=m["choices"],
                      metavar=None if m["choices"] else flag(f)[2:].replace("-", "_").upper())
        if m["type"] is not str:
            kwargs["type"] = m["type"]
        parser.add_argument(flag(f), *m["aliases"], **kwargs)


def from_args(args, method: str, methods: tuple[str, ...]) -> dict:
    """One method's options from parsed flags. --draft is a path, or METHOD=PATH pairs (from `methods`) when a
    benchmark runs several."""
    out = {name: getattr(args, name) for name in Options.names()}
    draft = out["draft_path"]
    if draft and "=" in draft:
        pairs = dict(item.partition("=")[::2] for item in draft.split(","))
        unknown = set(pairs) - set(methods)
        if unknown:
            raise UserError(f"--draft names unknown methods {sorted(unknown)}; choose from {', '.join(methods)}")
        out["draft_path"] = pairs.get(method)
    return out


def variants(spec: str) -> list[str]:
    """A benchmark's method with options set, `METHOD@FLAG=V+FLAG=V` (a flag's name without its dashes, `default` for
    the method's own), each value a `|`-separated list to try: `s3d@gamma=2|4+lookup=0|1` is four variants, one name
    each (`s3d@gamma=2+lookup=0`, ...). A name without `@` is the method at the run's flags."""
    method, at, rest = spec.partition("@")
    if not at:
        return [spec]
    pairs = [item.partition("=") for item in rest.split("+")]
    for name, eq, values in pairs:
        if not eq or not values:
            raise UserError(f"method variant {spec!r}: write FLAG=VALUE, e.g. s3d@gamma=2+lookup=0")
    combos = itertools.product(*[[f"{name}={v}" for v in values.split("|")] for name, _, values in pairs])
    names = [f"{method}@{'+'.join(combo)}" for combo in combos]
    for name in names:
        variant(name)  # every value checked before anything is built
    return names


def variant(name: str) -> tuple[str, dict]:
    """A variant's method and the options it sets (`variants`), each value read as its flag reads it."""
    method, _, rest = name.partition("@")
    fields = {flag(f)[2:]: f for f in dataclasses.fields(Options)}
    out = {}
    for item in rest.split("+") if rest else ():
        key, _, value = item.partition("=")
        f = fields.get(key)
        if f is None:
            raise UserError(f"method variant {name!r}: unknown option {key!r}; choose from {', '.join(fields)}")
        if value == "default":
            out[f.name] = f.default
            continue
        choices = f.metadata["choices"]
        try:
            out[f.name] = f.metadata["type"](value)
        except ValueError:
            raise UserError(f"method variant {name!r}: {key} takes {f.metadata['type'].__name__} values, not {value!r}") from None
        if choices and value not in choices:
            raise UserError(f"method variant {name!r}: {key} is one of {', '.join(choices)}, not {value!r}")
    return method, out
