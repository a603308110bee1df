"""Calibration throughput, memory and capture overhead (``python -m sketchcal.calibrate.benchmark``).

Builds a random-weight model with a real config (or a built-in tiny one), then measures in one
process: plain ``generate()`` on the calibration prompts, and ``sketchcal.calibrate`` on the same
prompts (generation + capture). Each sample count runs in its own subprocess so that peak host
memory (ru_maxrss) is per run. Prints one JSON line per run and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from sketchcal.models.real import real_config


def build_model_dir(kind: str, root: Path, dtype: torch.dtype, device: str) -> str:
    """Save a random-weight model of ``kind`` ("qwen3.5-4b") with the built-in tokenizer."""
    import transformers as tf

    from sketchcal.data import builtin_tokenizer_path

    out = root / kind
    if (out / "config.json").exists():
        return str(out)
    tok = tf.AutoTokenizer.from_pretrained(builtin_tokenizer_path())
    cfg = real_config("qwen3.5-4b")
    cfg.eos_token_id = cfg.pad_token_id = tok.eos_token_id
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def one_run(args: argparse.Namespace) -> dict:
    import sketchcal

    args.samples = args.samples[0]
    from sketchcal.data import build_samples
    from sketchcal.models.loading import load_model

    result = {
        "model": args.model,
        "samples": args.samples,
        "seq_len": args.seq_len,
        "gen_tokens": args.gen_tokens,
        "batch_size": args.batch_size,
        "device": args.device,
    }
    if args.gen_tokens > 0 and not args.no_plain:  # plain generation of the same prompts, same batches
        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
        samples = build_samples(loaded.tokenizer, None, num_samples=args.samples, seq_len=args.seq_len)
        ids = torch.tensor(samples.calib, device=loaded.device)
        loaded.model.generate(ids[: args.batch_size], max_new_tokens=2, do_sample=False)  # warm-up
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(0, len(ids), args.batch_size):
            batch = ids[i : i + args.batch_size]
            loaded.model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=args.gen_tokens,
                min_new_tokens=args.gen_tokens,
                do_sample=False,
            )
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        result["plain_generate_seconds"] = round(time.perf_counter() - t0, 3)
        del loaded
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        manifest = sketchcal.calibrate(
            args.model,
            out=Path(tmp) / "stats",
            samples=args.samples,
            seq_len=args.seq_len,
            gen_tokens=args.gen_tokens,
            batch_size=args.batch_size,
            heldout_samples=0,
            device=args.device,
            dtype=args.dtype,
            progress=False,
            save_every=10**6,
        )
        wall = time.perf_counter() - t0
    t = manifest["timing"]
    tokens = manifest["tokens"]["calib"]
    result.update(
        calibrate_seconds=round(wall, 3),
        loop_seconds=t["seconds"],
        tokens=tokens["prompt"] + tokens["decode"],
        tokens_per_second=t["tokens_per_second"],
        generation_seconds=t["generation_seconds"],
        capture_seconds=t["capture_seconds"],
        peak_host_memory_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        peak_device_memory_mib=t["peak_device_memory_mib"],
    )
    if "plain_generate_seconds" in result:
        result["capture_overhead"] = round(t["capture_seconds"] / result["plain_generate_seconds"], 3)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--model", default="builtin:tiny-gdn", help="builtin:NAME, a directory, or qwen3.5-4b (random)"
    )
    p.add_argument("--samples", type=int, nargs="+", default=[32, 64])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workdir", default=None)
    p.add_argument("--no-plain", action="store_true", help="skip the separate plain generate() timing")
    p.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.single:
        print("RESULT " + json.dumps(one_run(args)), flush=True)
        return
    if args.model == "qwen3.5-4b":
        root = Path(args.workdir or tempfile.mkdtemp())
        args.model = build_model_dir("qwen3.5-4b", root, torch.bfloat16, args.device)
    rows = []
    for n in args.samples:
        cmd = [
            sys.executable,
            "-m",
            "sketchcal.calibrate.benchmark",
            "--single",
            "--model",
            args.model,
            "--samples",
            str(n),
            "--seq-len",
            str(args.seq_len),
            "--gen-tokens",
            str(args.gen_tokens),
            "--batch-size",
            str(args.batch_size),
            "--device",
            args.device,
            "--dtype",
            args.dtype,
            *(["--no-plain"] if args.no_plain else []),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"benchmark run with {n} samples failed")
        rows.append(json.loads(line[7:]))
        print(line, flush=True)
    keys = [
        "samples",
        "tokens",
        "tokens_per_second",
        "generation_seconds",
        "capture_seconds",
        "plain_generate_seconds",
        "capture_overhead",
        "peak_host_memory_mib",
        "peak_device_memory_mib",
    ]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")


if __name__ == "__main__":
    main()
