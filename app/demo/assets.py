"""The demo's assets, built by `loraland demo-assets`: a tiny character-level Llama and three task adapters.

    <out>/base/                 HF model folder (config.json, model.safetensors, tokenizer files)
    <out>/adapters/<task>/      PEFT LoRA (adapter_config.json, adapter_model.safetensors)
    <out>/manifest.json         the spec's digest and the sha256 of every file above
    <out>/build_report.json     timings and held-out accuracies of this build (not hashed: they vary)

Everything is seeded and trained on CPU, so a rebuild on the same machine writes the same bytes. A folder
whose manifest matches the current spec is reused; --force rebuilds it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.config.model_config import LORA_MODULES
from app.config.settings import Settings
from app.demo.train import ADAPTER_TASKS, DataSpec, TrainSpec
from app.files import sha256_file

FORMAT = 1
BASE_NAME = "loraland-demo-base"
START, SEPARATOR = "^", "="  # added by the tokenizer's normalizer around every input
SPECIALS = ("<pad>", "</s>", "<unk>")
REPORT = "build_report.json"
DESCRIPTIONS = {  # what each adapter imitates, for people; the functions themselves are train.TASKS
    "upper": "str.upper(x)",
    "reverse": '" ".join(reversed(x.split()))',
    "rot13": 'codecs.encode(x, "rot13")',
}


@dataclass(frozen=True)
class DemoSpec:
    """Everything that determines the assets' bytes; its digest is recorded in the manifest."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    max_position_embeddings: int = 128
    seed: int = 0
    threads: int = 2
    data: DataSpec = DataSpec()
    base: TrainSpec = TrainSpec(steps=800, lr=5e-3, seed=1, mixed_case=True)
    adapters: dict[str, TrainSpec] = field(
        default_factory=lambda: {
            "upper": TrainSpec(steps=450, lr=5e-3, seed=2),
            "reverse": TrainSpec(steps=800, lr=5e-3, seed=3),
            "rot13": TrainSpec(steps=400, lr=5e-3, seed=4),
        }
    )
    # adapter -> the adapter it is also trained beside (both deltas active, the target the composition
    # upper(reverse(x))), so that the merge "reverse+upper" is one forward that equals the chain
    # "reverse|upper". LoRAs trained apart do not add up like that; a merge of them is only a blend.
    merge_ready: dict[str, str] = field(default_factory=lambda: {"upper": "reverse"})
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_targets: tuple[str, ...] = LORA_MODULES

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DemoSpec:
        return cls(
            **{
                **d,
                "data": DataSpec(**d["data"]),
                "base": TrainSpec(**d["base"]),
                "adapters": {k: TrainSpec(**v) for k, v in d["adapters"].items()},
                "lora_targets": tuple(d["lora_targets"]),
            }
        )

    def digest(self) -> str:
        # `threads` only changes speed (weights are bit-identical with 1 or 2 threads here), not the build.
        blob = {k: v for k, v in self.to_dict().items() if k != "threads"}
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


PACKAGED_DIR = Path(__file__).resolve().parent / "assets"  # used when a build was committed there


def default_dir(settings: Settings | None = None) -> Path:
    """<cache_dir>/demo: $LORALAND_CACHE_DIR/demo, else ~/.cache/loraland/demo."""
    return (settings or Settings.from_env()).cache_dir / "demo"


def locate_assets(say=print) -> Path:
    """The demo assets: a matching build committed under app/demo/assets, else the cache (built if needed)."""
    if (PACKAGED_DIR / "manifest.json").is_file():
        problem = check_assets(PACKAGED_DIR)
        if problem is None:
            return PACKAGED_DIR
        say(
            f"demo assets: not using {PACKAGED_DIR}: {problem}; rebuild it with "
            f"`loraland demo-assets --out {PACKAGED_DIR} --force`"
        )
    return build_assets(default_dir(), say=say)


def build_tokenizer(out_dir: Path | None = None):
    """A character-level tokenizer whose normalizer turns "text" into "^text=": a prompt is just the text.

    Adding the markers in the tokenizer (not asking callers to type them) is what lets a chain work:
    LLMKernel feeds a stage's decoded output to the next stage as a plain prompt. The start marker gives
    the model an anchor to count positions from, which makes copying exact even with repeated letters."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = [*SPECIALS, START, SEPARATOR, " ", *string.ascii_lowercase, *string.ascii_uppercase]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Strip(), normalizers.Prepend(START), normalizers.Replace(Regex(r"\z"), SEPARATOR)]
    )
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=START,
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        sep_token=SEPARATOR,
        clean_up_tokenization_spaces=False,
        model_max_length=128,
    )
    # A chat request is its last user message as is: the model knows no roles.
    fast.chat_template = "{{ messages[-1]['content'] }}"
    if out_dir is not None:
        fast.save_pretrained(out_dir)
    return fast


def _manifest(out: Path, spec: DemoSpec) -> dict:
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name not in ("manifest.json", REPORT))
    return {
        "format": FORMAT,
        "spec_digest": spec.digest(),
        "base": "base",
        "adapters": {t: {"path": f"adapters/{t}", "imitates": DESCRIPTIONS[t]} for t in ADAPTER_TASKS},
        "files": {p.relative_to(out).as_posix(): sha256_file(p) for p in files},
    }


def check_assets(out: Path, spec: DemoSpec | None = None) -> str | None:
    """None when `out` holds a complete, unchanged build of `spec`; else what is wrong with it."""
    spec = spec or DemoSpec()
    path = Path(out) / "manifest.json"
    if not path.is_file():
        return f"{out} has no manifest.json"
    try:
        m = json.loads(path.read_text())
    except ValueError as e:
        return f"{path} is not JSON ({e})"
    if m.get("format") != FORMAT or m.get("spec_digest") != spec.digest():
        return f"{out} was built from another spec (digest {m.get('spec_digest')}, this code wants {spec.digest()})"
    for rel, digest in m.get("files", {}).items():
        f = Path(out) / rel
        if not f.is_file() or sha256_file(f) != digest:
            return f"{f} is missing or changed since the build"
    return None


def build_assets(
    out: Path | None = None, *, force: bool = False, spec: DemoSpec | None = None, say=print
) -> Path:
    """Build the demo assets into `out` (default: <cache_dir>/demo) unless a matching build is there.

    Training runs in a child process: its torch threads and OpenMP settings stay its own, and passive
    OpenMP waiting keeps two threads from spinning against each other on a busy machine (several-fold
    slower otherwise)."""
    spec = spec or DemoSpec()
    out = Path(out) if out is not None else default_dir()
    problem = check_assets(out, spec)
    if not force and problem is None:
        say(f"demo assets: reusing {out}")
        return out
    say(f"demo assets: building {out} ({'--force' if force else problem}); about 3 minutes on 2 CPU cores")
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-build-", dir=out.parent))
    try:
        env = {
            **os.environ,
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
            ),
            "TOKENIZERS_PARALLELISM": "false",
        }
        cmd = [sys.executable, "-m", "app.demo.build", str(tmp), json.dumps(spec.to_dict())]
        if subprocess.run(cmd, env=env).returncode != 0:
            raise RuntimeError(f"training the demo assets failed (see the output above); command: {cmd[:4]}")
        report = json.loads((tmp / REPORT).read_text())
        report["total_wall_s"] = round(time.perf_counter() - t0, 1)
        (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        (tmp / "manifest.json").write_text(json.dumps(_manifest(tmp, spec), indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the assets from other users of a shared checkout
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"demo assets: built {out} in {report['total_wall_s']:.0f}s")
    return out
