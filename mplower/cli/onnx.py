"""`mplower import` (ONNX -> IR + weights) and `mplower export` (IR -> ONNX).

Both write as one set (mplower.io.atomic): the IR and its .npz, or the .onnx, appear whole or
not at all, and a failing run leaves earlier files untouched. `import -o NAME.npz` is refused:
the weights beside it would be the same file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mplower.cli.common import (
    EXIT_OK,
    UsageError,
    check_outputs,
    input_name,
    materialize_and_say,
    parse_module,
    read_input,
    read_module,
    weights_beside,
    write_atomic_all,
    write_output,
    writes_outputs,
)


def _positive(text: str) -> int:
    """argparse type of a count of sequences, tokens or positions: 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def add_import(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="import an ONNX model or a HuggingFace checkpoint folder as "
                                  "IR (weights to an .npz beside it)",
                       description="Convert an ONNX model (opset 9 and up) to an mplower module "
                                   "with static shapes; large constants go to OUT.npz beside "
                                   "the IR. A folder is a HuggingFace checkpoint (config.json "
                                   "+ *.safetensors): its module has @prefill and @decode "
                                   "functions with the KV cache as arguments (docs/hf.md).")
    p.add_argument("model", help="the .onnx file, or a checkpoint folder")
    p.add_argument("-o", dest="output", required=True, help="the IR file to write")
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=DxDx...",
                   help="fix the shape of an input with dynamic dimensions (repeatable; "
                        "default: a dynamic batch dimension becomes 1)")
    p.add_argument("--outputs", metavar="NAME,...",
                   help="keep only these graph outputs, and only the nodes that feed them")
    p.add_argument("--eval-mode", action="store_true",
                   help="import training-mode Dropout (as the identity) and BatchNormalization "
                        "(with its running statistics) as inference, a note per node changed")
    hf = p.add_argument_group("checkpoint folders")
    hf.add_argument("--batch", type=_positive, metavar="B",
                    help="sequences per call of @prefill and @decode (default 1)")
    hf.add_argument("--seq", type=_positive, metavar="S",
                    help="prompt tokens of @prefill (default 128)")
    hf.add_argument("--context", type=_positive, metavar="C",
                    help="cached positions @decode reads; its token is position C (default: S)")
    hf.add_argument("--shapes-only", action="store_true",
                    help="read config.json alone (no safetensors): a module to price and "
                         "plan, whose weights read as zeros; no .npz is written")
    return p


def add_export(sub, name: str) -> argparse.ArgumentParser:
    e = sub.add_parser(name, help="export a (lowered) module as an ONNX model or a "
                                  "compressed-tensors checkpoint",
                       description="Write an ONNX model of the module's plan: narrow formats "
                                   "as Cast nodes, int8 as QuantizeLinear/DequantizeLinear, "
                                   "weights as initializers. A plan that is only annotations "
                                   "gets insert-casts first. What onnxruntime's CPU provider "
                                   "reproduces of mplower's executor (docs/onnx.md): casts, "
                                   "data movement, elementwise ops, quantize/dequantize with "
                                   "static or current scales of an input, and integer "
                                   "MatMul/Conv are bit-identical; float sums (MatMul, Conv, "
                                   "reductions, Softmax, normalizations) run in the runtime's "
                                   "own order, so their f32 results differ in the last bits, "
                                   "within 1 ULP of the plan's narrow format; where such a "
                                   "value is then rounded to fp8 (current scaling also takes "
                                   "its scale from their amax) it may land on the neighbouring "
                                   "code: each fp8 value is within one fp8 code of the "
                                   "executor's, and outputs downstream differ accordingly. "
                                   "--format compressed-tensors writes the checkpoint folder "
                                   "vLLM and transformers load (docs/export-checkpoint.md).")
    e.add_argument("input", help="IR file, or - for stdin")
    e.add_argument("--format", choices=("onnx", "compressed-tensors"), default="onnx")
    e.add_argument("-o", dest="output", required=True,
                   help="the .onnx file to write ('-': stdout, through a pipe); the folder "
                        "for compressed-tensors (replaced whole)")
    e.add_argument("--checkpoint", metavar="DIR",
                   help="compressed-tensors: the HF checkpoint folder the module was imported "
                        "from (its config.json, tensors kept in float and other files)")
    e.add_argument("--weights", help="weights .npz to use instead of the module's mp.weights")
    e.add_argument("--func", default=None, help="function to export (default: main or the "
                                                 "only one)")
    e.add_argument("--narrow-io", action="store_true",
                   help="keep bf16/fp8/i4 graph inputs and outputs in their own types (by "
                        "default they are exchanged as FLOAT/INT8, which onnxruntime's Python "
                        "API can feed and fetch)")
    e.add_argument("--weight-only", choices=("matmulnbits", "qdq"), default="matmulnbits",
                   help="weight-only matmuls (quantize{scheme=w4a16|w8a16}): onnxruntime's "
                        "com.microsoft.MatMulNBits with the plan's codes and a float "
                        "activation (default), or DequantizeLinear + MatMul (docs/onnx.md)")
    return e


@writes_outputs
def cmd_import(args: argparse.Namespace) -> int:
    from mplower.hf import is_checkpoint

    if is_checkpoint(args.model):
        return _import_checkpoint(args)
    given = [f for f in ("batch", "seq", "context") if getattr(args, f) is not None]
    if args.shapes_only:
        given.insert(0, "shapes-only")
    if given:
        raise UsageError(f"--{given[0]} is for checkpoint folders; {args.model} is a file "
                         f"(use --input-shape for an ONNX model)")

    from mplower.dialect.plan import WEIGHTS
    from mplower.io.npz import save_npz
    from mplower.ir.printer import print_module
    from mplower.onnx.importer import import_model, load_model, parse_input_shape

    shapes = {}
    for text in args.input_shape:
        try:
            name, shape = parse_input_shape(text)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if name in shapes and shapes[name] != shape:
            raise UsageError(f"--input-shape gives input '{name}' two shapes: "
                             f"{'x'.join(map(str, shapes[name]))} and {'x'.join(map(str, shape))}")
        shapes[name] = shape
    if args.output == "-":  # the weights go to a file beside it, which '-' has not
        raise UsageError("import writes the module and its weights beside it: -o needs a file, "
                         "not '-'")
    npz = weights_beside("-o", args.output)
    check_outputs({"-o": args.output, "the weights beside -o": npz}, {"model": args.model})
    outputs = None
    if args.outputs is not None:
        outputs = [o.strip() for o in args.outputs.split(",") if o.strip()]
    model = load_model(args.model)
    imported = import_model(model, args.model, input_shapes=shapes, outputs=outputs,
                            eval_mode=args.eval_mode)
    for note in imported.notes:
        sys.stderr.write(f"{args.model}: note: --eval-mode: {note}\n")
    module = imported.module
    if imported.weights:
        module.attrs[WEIGHTS] = npz.name
    source = f"// Imported from {Path(args.model).name} by `mplower import`.\n"
    text = source + print_module(module)
    files = [(args.output, lambda fh: fh.write(text), "w")]
    if imported.weights:
        files.insert(0, (npz, lambda fh: save_npz(fh, imported.weights), "wb"))
    write_atomic_all(files)
    return EXIT_OK


def _import_checkpoint(args: argparse.Namespace) -> int:
    from mplower.dialect.plan import WEIGHTS
    from mplower.hf import import_checkpoint
    from mplower.io.npz import save_npz
    from mplower.ir.printer import print_module

    for flag, value in (("--input-shape", args.input_shape), ("--outputs", args.outputs),
                        ("--eval-mode", args.eval_mode)):
        if value:
            raise UsageError(f"{flag} is for ONNX models; {args.model} is a checkpoint folder "
                             f"(its shapes come from --batch, --seq and --context)")
    if args.output == "-":
        raise UsageError("import writes the module and its weights beside it: -o needs a file, "
                         "not '-'")
    npz = weights_beside("-o", args.output)
    folder = Path(args.model)
    inputs = {f"{args.model} file {p.name}": p for pattern in ("*.json", "*.safetensors")
              for p in folder.glob(pattern)}
    outputs = {"-o": args.output} if args.shapes_only else {
        "-o": args.output, "the weights beside -o": npz}
    check_outputs(outputs, inputs)
    seq = args.seq or 128
    imported = import_checkpoint(args.model, args.batch or 1, seq, args.context or seq,
                                 shapes_only=args.shapes_only)
    module = imported.module
    source = (f"// Imported from the {imported.architecture} checkpoint "
              f"{Path(args.model).name} by `mplower import`"
              f"{' (shapes only: no weights)' if args.shapes_only else ''}.\n")
    if args.shapes_only:
        text = source + print_module(module)
        write_atomic_all([(args.output, lambda fh: fh.write(text), "w")])
        return EXIT_OK
    module.attrs[WEIGHTS] = npz.name
    text = source + print_module(module)
    write_atomic_all([(npz, lambda fh: save_npz(fh, imported.weights), "wb"),
                      (args.output, lambda fh: fh.write(text), "w")])
    return EXIT_OK


@writes_outputs
def cmd_export(args: argparse.Namespace) -> int:
    if args.format == "compressed-tensors":
        return _export_checkpoint(args)
    if args.checkpoint is not None:
        raise UsageError("--checkpoint is for --format compressed-tensors")
    from mplower.ir.diagnostics import Location
    from mplower.onnx.exporter import check_and_serialize, export_module

    check_outputs({"-o": args.output}, {"input": args.input, "--weights": args.weights},
                  binary=("-o",))
    module = read_module(args)
    materialize_and_say(module, args, "export")  # a plan still only annotations gets casts
    exported = export_module(module, args.func, args.weights, args.narrow_io, args.weight_only)
    name = input_name(args.input)
    data = check_and_serialize(exported.model, Location(name, 0, 0))
    write_output(args.output, data)
    for note in exported.notes:
        sys.stderr.write(f"{name}: note: {note}\n")
    return EXIT_OK


def _export_checkpoint(args: argparse.Namespace) -> int:
    import json
    import os
    import shutil

    from mplower.hf.compressed_tensors import export_checkpoint
    from mplower.hf.safetensors_writer import write_safetensors
    from mplower.io.atomic import staged_folder

    if args.checkpoint is None:
        raise UsageError("--format compressed-tensors needs --checkpoint DIR, the HF folder "
                         "the module was imported from")
    if args.output == "-":
        raise UsageError("--format compressed-tensors writes a folder: -o needs a path, not '-'")
    for flag, given in (("--narrow-io", args.narrow_io), ("--func", args.func is not None)):
        if given:
            raise UsageError(f"{flag} is for --format onnx; a checkpoint holds the weights of "
                             f"every function")
    out = Path(os.path.realpath(args.output))
    source = Path(os.path.realpath(args.checkpoint))
    if out == source or source.is_relative_to(out) or out.is_relative_to(source):
        raise UsageError(f"-o {args.output} would replace or lie inside the checkpoint "
                         f"{args.checkpoint}; write the export to a folder of its own")
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {args.output} is a file; compressed-tensors writes a folder")
    text, name = read_input(args.input)
    args._source = text  # main shows source lines with later diagnostics
    module = parse_module(text, name)
    materialize_and_say(module, args, "export")
    exported = export_checkpoint(module, source, args.weights)
    with staged_folder(out) as stage:
        with open(stage / "model.safetensors", "wb") as fh:
            write_safetensors(fh, exported.tensors, {"format": "pt"})
        (stage / "config.json").write_text(json.dumps(exported.config, indent=2) + "\n")
        for f in exported.files:
            shutil.copyfile(f, stage / f.name)
    for note in exported.notes:
        sys.stderr.write(f"{name}: note: {note}\n")
    return EXIT_OK
