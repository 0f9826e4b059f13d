"""A decoder checkpoint run one transformer block at a time: calibration, weight quantization
and evaluation of a model bigger than memory ("sequential onloading", as llm-compressor and
TensorRT Model Optimizer calibrate large models).

The prefill of a Llama-family checkpoint is cut into blocks: the embedding, each decoder layer,
and the final norm with lm_head. A block is a module of its own (one function `@main`, built
by the same code as `mplower import`'s whole `@prefill`, so its ops are that function's ops of
the block, in the same order) whose weights are the block's tensors of the memory-mapped
safetensors, widened to f32 when first read and dropped with the block. `run_blocks` takes the
calibration sequences through the model block by block, holding two residual streams (the
plan's and the fp32 reference's, a few MB each):

1. build the block and its weights;
2. with a `quantizer`, hand it each matmul weight [in, out] and that matmul's inputs in the fp32
   reference [tokens, in], and compute with the weight it returns (the per-layer hook of GPTQ
   and AWQ; round-to-nearest needs no hook: it is the `quantize` pass);
3. run the pass pipeline on the block, a `calibrate` pass on the block's reference inputs;
4. run the block's plan and its fp32 reference side by side (Program.run), keeping each op's
   counts and drift, not its tensors; the outputs are the next block's inputs; free the block.

Peak memory is about one block's weights in f32 plus the activations of one block. Every op
runs on the same kernel, with the same operands, as in the whole module, so the logits, the
calibrated ranges and the quantized weights are the bits the whole-model path gives
(tests/test_hf_blocks.py).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mplower.backend.executor import OpResult, Program, RunResult, reference_runner
from mplower.dialect.plan import WEIGHT_QUANT
from mplower.hf import gpt2, llama
from mplower.hf.build import Builder, LazyWeights
from mplower.hf.config import Config
from mplower.hf.safetensors import Checkpoint, inside
from mplower.io.npz import save_npz
from mplower.ir.diagnostics import DiagnosticError, Location
from mplower.ir.graph import Function, Module
from mplower.ir.types import DenseAttr, tensor
from mplower.ir.verifier import verify
from mplower.pass_manager import Pass, PassContext
from mplower.passes.calibrate import Calibrate
from mplower.passes.insert_casts import materialize
from mplower.passes.quantize import DATA_METHODS, Quantize
from mplower.report.run import check_reference

# quantizer(weight key, weight [in, out] f32, its matmul's inputs [tokens, in] f32 from the
# fp32 reference) -> the weight the matmul computes with, [in, out] f32.
WeightQuantizer = Callable[[str, np.ndarray, np.ndarray], np.ndarray]


@dataclass
class Block:
    """One block of a checkpoint's prefill: a module with one function `@main` and the arrays
    its named constants read, each made when first read and kept while the block lives."""

    name: str  # "embed", "layers.3", "head"
    module: Module
    weights: BlockWeights


class BlockWeights(Mapping[str, np.ndarray]):
    """A block's weights: made from the mapped checkpoint on first read, kept until the block
    is dropped (every reader of the block shares one f32 copy); `replace` swaps one in."""

    def __init__(self, lazy: LazyWeights):
        self._lazy = lazy
        self._made: dict[str, np.ndarray] = {}

    def __getitem__(self, key: str) -> np.ndarray:
        arr = self._made.get(key)
        if arr is None:
            arr = self._made[key] = self._lazy[key]
        return arr

    def __iter__(self) -> Iterator[str]:
        return iter(self._lazy)

    def __len__(self) -> int:
        return len(self._lazy)

    def replace(self, key: str, arr: np.ndarray) -> None:
        self._made[key] = arr

    @property
    def read(self) -> list[str]:
        """The keys read so far."""
        return list(self._made)


class Blocks:
    """The prefill of the Llama-family checkpoint in `folder`, for `batch` sequences of `seq`
    tokens, as a sequence of blocks built on demand."""

    def __init__(self, folder: str | Path, batch: int, seq: int):
        folder = Path(folder)
        self.loc = Location(str(folder), 0, 0)
        cfg = Config(inside(folder, "config.json", "file", folder))
        arch = cfg.architecture()
        if arch not in llama.ARCHITECTURES:
            known = ", ".join(llama.ARCHITECTURES)
            what = "GPT-2 is imported whole" if arch in gpt2.ARCHITECTURES else "unsupported"
            raise cfg.error(f"architecture '{arch}': mplower runs {known} block by block "
                            f"({what})")
        self.model = llama.read_config(cfg, arch)
        if seq > self.model.max_positions:
            raise cfg.error(f"{seq} positions exceed the model's {self.model.max_positions} "
                            f"(max_position_embeddings)")
        self.ckpt = Checkpoint(folder)
        self.batch, self.seq = batch, seq
        self.names = ["embed", *(f"layers.{i}" for i in range(self.model.layers)), "head"]

    def __len__(self) -> int:
        return len(self.names)

    def block(self, k: int) -> Block:
        """Block `k` of `names`: its module and its (not yet read) weights."""
        m, name = self.model, self.names[k]
        b = Builder(self.ckpt, self.loc)
        hidden = tensor((self.batch, self.seq, m.hidden), "f32")
        if name == "embed":
            (ids,) = b.start("main", [("input_ids", tensor((self.batch, self.seq), "i64"))])
            out = llama.embed(b, m, ids)
        elif name == "head":
            (x,) = b.start("main", [("hidden", hidden)])
            out = llama.head(b, m, x)
        else:
            (x,) = b.start("main", [("hidden", hidden)])
            tables = llama.position_tables(b, m, 0, self.seq)
            out, _ = llama.layer(b, m, x, k - 1, tables, None)
        module = Module(name=None, path=str(self.loc.file), loc=self.loc)
        module.functions["main"] = b.finish([("logits" if name == "head" else "hidden", out)])
        verify(module)
        return Block(name, module, BlockWeights(b.weights))


def weight_matmuls(f: Function) -> list[tuple[int, str]]:
    """(node, weight key) of each `x @ W` whose W is a named constant, in program order."""
    out = []
    for n in f.ops():
        if f.op(n) != "mp.matmul":
            continue
        w = f.operands(n)[1]
        if f.op(w[0]) == "mp.constant" and "name" in f.attrs_of(w[0]):
            out.append((n, f.attrs_of(w[0])["name"]))
    return out


@dataclass
class BlockRun:
    """What one block left behind: its name, the weights it read, its ops' figures."""

    name: str
    weights: list[str]
    ops: list[OpResult]
    quantized: dict[str, str] = field(default_factory=dict)  # weight key -> how


@dataclass
class StreamResult:
    """The logits of the plan and of the model's fp32 reference (the checkpoint as it is,
    before any pass or quantizer), and every block's op figures. Each op's drift is against
    the reference of its own block's plan, which starts from the reference stream of the
    blocks before it; where a quantizer replaced weights, that reference computes with them
    (so the drift of a weight's matmul there is the activations' alone)."""

    logits: np.ndarray
    reference: np.ndarray
    blocks: list[BlockRun]

    def run_result(self) -> RunResult:
        """The whole run as one RunResult (op names prefixed by their block's), what
        mplower.report.run.build_report reads. Each block's reference was checked for
        non-finite values when it ran, so the slots a failed check would look at are empty."""
        ops = [dataclasses.replace(r, step=dataclasses.replace(r.step, name=f"{b.name}/"
                                                                           f"{r.step.name}"))
               for b in self.blocks for r in b.ops]
        slots = 1 + max((i for r in ops for i in (*r.step.inputs, r.step.output)), default=0)
        return RunResult([self.logits], [self.reference], ops, [], [],
                         lambda: [None] * slots)


def run_blocks(blocks: Blocks, input_ids: np.ndarray, passes: Sequence[Pass] = (),
               quantizer: WeightQuantizer | None = None,
               on_block: Callable[[Block, BlockRun], None] | None = None,
               evaluate: bool = True) -> StreamResult:
    """Run `input_ids` [batch, seq] through `blocks` one block at a time (module docstring):
    the pass pipeline `passes` and the `quantizer` applied to each block, the plan run beside
    the fp32 reference. `on_block` sees each block after it ran (its module lowered), before
    it is dropped. Without `evaluate`, the blocks are calibrated and quantized but their plans
    not run: the logits are the reference's, and no op has figures."""
    ids = np.asarray(input_ids)
    if ids.shape != (blocks.batch, blocks.seq):
        raise DiagnosticError.at(blocks.loc, f"input_ids have shape {list(ids.shape)}; the "
                                             f"blocks take [{blocks.batch}, {blocks.seq}]")
    x = ref = cal = ids
    runs = []
    with tempfile.TemporaryDirectory(prefix="mplower-blocks-") as tmp:
        for k in range(len(blocks)):
            block = blocks.block(k)
            run, x, ref, cal = _run_block(block, x, ref, cal, passes, quantizer, Path(tmp),
                                          evaluate)
            if on_block is not None:
                on_block(block, run)
            runs.append(run)
            del block  # its weights and compiled program go before the next block's come
            blocks.ckpt.release()  # and the pages of the checkpoint it read
    return StreamResult(x, cal, runs)


def _run_block(block: Block, x: np.ndarray, ref: np.ndarray, cal: np.ndarray,
               passes: Sequence[Pass], quantizer: WeightQuantizer | None, tmp: Path,
               evaluate: bool = True) -> tuple[BlockRun, np.ndarray, np.ndarray, np.ndarray]:
    """One block: (what it left, the plan's output, the plan's reference output, the output
    of the block as it was before the passes, in the fp32 reference). The last one is what
    the next block calibrates on: a lowered plan's reference keeps float ops the passes added
    (quantize's activation shift), which are not bitwise the unlowered model's."""
    module, weights = block.module, block.weights
    f = module.function("main")
    arg = f.data(f.args[0])["name"]
    targets = weight_matmuls(f)  # before a pass puts a dequantize between matmul and weight
    quantized: dict[str, str] = {}
    cal_next = None
    if quantizer is not None or passes or not evaluate:
        cal_next, inputs = _unlowered_reference(block, cal, quantizer is not None)
        if quantizer is not None:
            quantized = _quantize_weights(block, inputs, quantizer)
    if passes:
        ctx = PassContext(weights_path=weights, runner=reference_runner)  # type: ignore[arg-type]
        data = tmp / f"{block.name}.npz"
        for p in passes:
            # calibrate, and quantize's gptq / awq statistics where no data= was named, run
            # on this block's inputs in the fp32 reference
            if isinstance(p, Calibrate) or (isinstance(p, Quantize) and not p.data
                                            and p.method in DATA_METHODS):
                if not data.exists():
                    with open(data, "wb") as fh:
                        save_npz(fh, {arg: cal})
                p = dataclasses.replace(p, data=str(data))
            p.run(module, ctx)
            verify(module)
        data.unlink(missing_ok=True)
    for n, key in targets:
        if WEIGHT_QUANT in f.attrs_of(n):
            quantized.setdefault(key, f.attrs_of(n)[WEIGHT_QUANT])
    if not evaluate:
        return BlockRun(block.name, weights.read, [], quantized), cal_next, cal_next, cal_next
    materialize(module)
    result = Program(module, "main", weights).run([x], reference_inputs=[ref])
    check_reference([r.step for r in result.ops], result.all_refs or result.refs,
                    result.reference)
    run = BlockRun(block.name, weights.read, [_figures_only(r) for r in result.ops], quantized)
    y, y_ref = result.outputs[0], result.reference[0]
    return run, y, y_ref, y_ref if cal_next is None else cal_next


def _figures_only(r: OpResult) -> OpResult:
    """The op's figures without what its step holds of the block: its constant (a weight),
    its kernels (closures over weights and packed copies of them) and its array attributes
    (a quantized weight's integer codes: kept, they grew a GPTQ run by ~90 MB a block)."""
    attrs = {k: v for k, v in r.step.attrs.items() if not isinstance(v, (DenseAttr, np.ndarray))}
    step = dataclasses.replace(r.step, run=_dropped, reference=_dropped, constant=None,
                               fast=None, amax_kernel=None, conv=None, attrs=attrs)
    return dataclasses.replace(r, step=step)


def _dropped(xs: list) -> None:
    raise RuntimeError("this step's block was dropped after it ran; only its figures remain")


def _unlowered_reference(block: Block, cal: np.ndarray,
                         with_inputs: bool) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The block's output in the fp32 reference before any pass, and (`with_inputs`) each
    matmul weight's activation [tokens, in] in it."""
    f = block.module.function("main")
    program = Program(block.module, "main", block.weights, reference_only=True)
    wanted: dict[int, list[str]] = {}  # q, k and v (gate and up) read one activation
    if with_inputs:
        for n, key in weight_matmuls(f):
            wanted.setdefault(program.slots[f.operands(n)[0]], []).append(key)
    out_slot = program.outputs[0]
    inputs: dict[str, np.ndarray] = {}
    out: list[np.ndarray] = []

    def observe(slot: int, y: np.ndarray | None) -> None:
        if slot == out_slot:
            out.append(y)
        if slot in wanted and y is not None:
            rows = np.ascontiguousarray(y.reshape(-1, y.shape[-1]))
            inputs.update(dict.fromkeys(wanted[slot], rows))

    program.run_reference([cal], observe)
    return out[0], inputs


def _quantize_weights(block: Block, inputs: dict[str, np.ndarray],
                      quantizer: WeightQuantizer) -> dict[str, str]:
    """Each matmul weight of the block replaced by quantizer(key, W, X), X its matmul's
    inputs in the unlowered fp32 reference (all taken before any weight changes, as the whole
    model's calibration sees them)."""
    targets = weight_matmuls(block.module.function("main"))
    done = {}
    for key in dict.fromkeys(key for _, key in targets):
        w = block.weights[key]
        new = np.asarray(quantizer(key, w, inputs.pop(key)), np.float32)
        if new.shape != w.shape:
            raise DiagnosticError.at(block.module.loc, f"the quantizer returned shape "
                                                       f"{list(new.shape)} for weight '{key}' "
                                                       f"of shape {list(w.shape)}")
        block.weights.replace(key, new)
        done[key] = "quantizer"
    return done
