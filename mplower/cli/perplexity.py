"""`mplower perplexity`: bits per token of a checkpoint on text, by the prefill path (one pass
over the text) and by the decode path (a prompt, then one decode step per token with the KV
cache), which must agree (mplower/hf/perplexity.py, docs/hf.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mplower.cli.common import EXIT_GUARDRAIL, EXIT_OK, UsageError

PATH_CHOICES = ("both", "prefill", "decode")


def add_perplexity(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="perplexity (bits per token) of a checkpoint on text, by the "
                                  "prefill and the decode path",
                       description="Score the tokens of a text after its prompt with a "
                                   "HuggingFace checkpoint folder: by @prefill over the whole "
                                   "text, and by @prefill over the prompt then one @decode step "
                                   "per token (teacher forcing, the KV cache carried). Both "
                                   "report mean NLL, bits per token and perplexity over the "
                                   "same tokens.")
    p.add_argument("model", metavar="CKPT_DIR", help="checkpoint folder (config.json + "
                                                     "*.safetensors)")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", metavar="FILE", help="UTF-8 text, its bytes as the tokens "
                                                     "(a byte-level vocabulary of 256)")
    text.add_argument("--tokens", metavar="IDS.npz", help="an .npz with `input_ids` [B, T] "
                                                          "(or [T])")
    p.add_argument("--prompt", type=int, default=1,
                   help="tokens the decode path gives @prefill (default 1); both paths score "
                        "the tokens after them")
    p.add_argument("--path", choices=PATH_CHOICES, default="both",
                   help="which path to run (default both)")
    p.add_argument("--pass-pipeline", default="", metavar="STR",
                   help="passes to lower every module with first, e.g. "
                        "'quantize-kv{granularity=token}'")
    p.add_argument("--check", action="store_true",
                   help="exit 3 when the two paths' NLL differ by more than --tolerance "
                        "(relative)")
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="relative tolerance of --check (default 1e-5)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    return p


def cmd_perplexity(args: argparse.Namespace) -> int:
    import numpy as np

    from mplower.hf import is_checkpoint
    from mplower.hf.perplexity import PATHS, byte_tokens, score
    from mplower.io.npz import read_npz
    from mplower.ir.diagnostics import DiagnosticError, Location
    from mplower.pass_manager import PipelineError, parse_pipeline

    if not is_checkpoint(args.model):
        raise UsageError(f"{args.model} is not a checkpoint folder (config.json + "
                         f"*.safetensors)")
    if args.check and args.path != "both":
        raise UsageError("--check compares the two paths: it needs --path both")
    try:
        parse_pipeline(args.pass_pipeline) if args.pass_pipeline else None
    except PipelineError as e:
        raise UsageError(str(e)) from None
    if args.text is not None:
        try:
            ids = byte_tokens(Path(args.text).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise DiagnosticError.at(Location(args.text, 0, 0),
                                     f"cannot read the text: {e}") from None
    else:
        where = Location(args.tokens, 0, 0)
        arrays = read_npz(Path(args.tokens), where, "tokens")
        if "input_ids" not in arrays:
            raise DiagnosticError.at(where, f"no array 'input_ids' (it has: "
                                            f"{', '.join(arrays) or 'none'})")
        ids = np.asarray(arrays["input_ids"])
        if ids.dtype.kind not in "iu" or ids.ndim not in (1, 2):
            raise DiagnosticError.at(where, f"'input_ids' must be integers [B, T] or [T], "
                                            f"got {ids.dtype} {list(ids.shape)}")
        ids = ids.reshape(-1, ids.shape[-1])
    paths = PATHS if args.path == "both" else (args.path,)
    scores = score(args.model, ids, args.prompt, paths, args.pass_pipeline)
    report = {"paths": {p: s.to_json() for p, s in scores.items()}}
    rel = None
    if len(scores) == 2:
        a, b = scores["prefill"].nll, scores["decode"].nll
        rel = abs(a - b) / abs(a) if a else abs(b)
        report["nll_rel_diff"] = rel
    if args.format == "json":
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(f"{'path':<8} {'tokens':>6} {'nll':>10} {'bits/token':>11} "
                         f"{'perplexity':>11}\n")
        for p, s in scores.items():
            sys.stdout.write(f"{p:<8} {s.tokens:>6} {s.nll:>10.6f} {s.bits_per_token:>11.6f} "
                             f"{s.perplexity:>11.4f}\n")
        if rel is not None:
            sys.stdout.write(f"paths agree to {rel:.2e} (relative NLL)\n")
    if args.check and rel is not None and not rel <= args.tolerance:
        sys.stderr.write(f"mplower perplexity: the decode path's NLL differs from the prefill "
                         f"path's by {rel:.2e} (relative), over --tolerance {args.tolerance:g}\n")
        return EXIT_GUARDRAIL
    return EXIT_OK
