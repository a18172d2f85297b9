"""Baselines: the gate prompts' outputs of one build, recorded to a file and checked later.

`tf-async gate --record FILE` runs the gate prompts solo (greedy and seeded) under a few
settings and writes their token ids and top log-probs; `tf-async gate --against FILE` runs the
same requests on this build with every optional feature off and compares token for token
(log-probs within the file's tolerance). The gates compare two settings of one build; a
baseline compares this build with an earlier one, so a kernel or engine change that alters
the default path's outputs is caught.

    section      engine settings                          log-probs
    flags off    Engine defaults, new features off        top 5
                 (paged, 16-row pages, no prefix cache)
    paging       paged, 4-row pages (many boundaries)     none (tokens: the device sampler)
    contiguous   one contiguous run a lane                top 5
    resumed      prefix cache on, 4-row pages: each       top 5, against "flags off"
                 request sent twice, the second compared  (not stored: the same requests)
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__
from .api import Engine
from .errors import BadInputError
from .gate import PROMPTS, sampling
from .models.checkpoint import Checkpoint

BASELINE_FORMAT = "tf_async gate baseline 1"
TOP_LOGPROBS = 5
LOGPROB_DECIMALS = 8  # stated precision of the stored log-probs
MODES = ("greedy", "seeded")


@dataclass(frozen=True, slots=True)
class Section:
    """One engine setting whose solo outputs a baseline keeps."""

    name: str
    line: str  # the printed comparison, e.g. "paging == baseline paging"
    engine: dict[str, Any]
    logprobs: bool
    expected: str = ""  # the recorded section it is compared with ("": its own, recorded)
    repeat: bool = False  # send each request twice and keep the second (a resumed request)

    @property
    def recorded(self) -> bool:
        return not self.expected


SECTIONS = (
    Section("flags off", "flags off == baseline", {"prefix_cache": False}, True),
    Section("paging", "paging == baseline paging",
            {"paging": True, "page_size": 4, "prefix_cache": False}, False),
    Section("contiguous", "contiguous == baseline contiguous", {"paging": False}, True),
    Section("resumed", "resumed == baseline", {"page_size": 4, "prefix_cache": True}, True,
            expected="flags off", repeat=True),
)


@dataclass(frozen=True, slots=True)
class BaselineSettings:
    """What a baseline's requests were run with (besides each section's engine settings)."""

    device: str  # "cpu" or "cuda" (resolved, never "auto")
    kv_dtype: str = "f32"
    ctx: int = 256
    max_tokens: int = 16
    temperature: float = 0.9
    num_prompts: int = len(PROMPTS)
    logprob_tolerance: float = 0.0  # |recorded - now| allowed per log-prob after rounding


@dataclass(frozen=True, slots=True)
class SectionResult:
    line: str
    passed: int
    total: int
    mismatches: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.passed == self.total

    def format(self) -> str:
        return f"{self.line} {self.passed}/{self.total}"


# ---- identity of what produced a baseline ------------------------------------------------
def model_fingerprint(ckpt: Checkpoint) -> str:
    """Config (less its folder name), load metadata and final-norm weights: the same model
    loaded from any folder has the same fingerprint."""
    config = {f.name: getattr(ckpt.config, f.name) for f in fields(ckpt.config) if f.name != "name"}
    digest = hashlib.sha256(repr(sorted(config.items())).encode())
    digest.update(json.dumps(ckpt.meta, sort_keys=True, default=str).encode())
    digest.update(np.ascontiguousarray(np.asarray(ckpt.weights.final_norm, np.float32)).tobytes())
    return digest.hexdigest()[:16]


def cpu_vector_isa() -> str:
    """The widest x86 vector set Numba may use here: fastmath reductions follow its width."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return platform.machine()
    for isa in ("avx512f", "avx2", "avx"):
        if isa in flags:
            return isa
    return platform.machine()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=Path(__file__).parent, check=False)
    except OSError:
        return None
    return out.stdout.strip() or None


def _gpu_name() -> str:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])


def _producer(device: str) -> dict[str, Any]:
    import numba

    host = {"machine": platform.machine(), "python": platform.python_version(),
            "numpy": np.__version__, "numba": numba.__version__}
    if device == "cpu":
        host["cpu_vector_isa"] = cpu_vector_isa()
    else:
        host["gpu"] = _gpu_name()
    return {"engine_version": __version__, "git_commit": _git_commit(), "host": host}


# ---- running the requests ----------------------------------------------------------------
def _logprob_rows(logprobs: list[dict[int, float]] | None) -> list[list[list[float]]] | None:
    """Per token: [[token id, log-prob], ...] best first, rounded to LOGPROB_DECIMALS."""
    if logprobs is None:
        return None
    return [[[int(t), round(float(lp), LOGPROB_DECIMALS)]
             for t, lp in sorted(step.items(), key=lambda kv: (-kv[1], kv[0]))]
            for step in logprobs]


async def _run_section(ckpt: Checkpoint, settings: BaselineSettings, section: Section,
                       tensor_parallel: int = 1) -> list[dict[str, Any]]:
    """Every prompt alone (one lane, one at a time), greedy then seeded."""
    options = dict(device=settings.device, kv_dtype=settings.kv_dtype, ctx=settings.ctx,
                   parallel=1, tensor_parallel=tensor_parallel, **section.engine)
    out = []
    async with Engine(ckpt, **options) as eng:
        for mode in MODES:
            for index, prompt in enumerate(PROMPTS[:settings.num_prompts]):
                params = sampling(mode, index, settings.max_tokens, settings.temperature)
                params["ignore_eos"] = True  # every request runs its max_tokens
                if section.logprobs:
                    params["logprobs"] = TOP_LOGPROBS
                if section.repeat:  # the first one leaves its prompt's pages in the cache
                    await eng.complete(prompt, **params)
                done = await eng.complete(prompt, **params)
                out.append({"prompt": index, "mode": mode, "seed": params.get("seed"),
                            "token_ids": list(done.token_ids),
                            "logprobs": _logprob_rows(done.logprobs)})
    return out


async def record(ckpt: Checkpoint, settings: BaselineSettings, *, reason: str,
                 model_name: str | None = None) -> dict[str, Any]:
    """A baseline document for `ckpt` (see the module docstring); `model_name` defaults to the
    checkpoint's file or folder name."""
    sections = {s.name: {"engine": s.engine, "logprobs": s.logprobs,
                         "requests": await _run_section(ckpt, settings, s)}
                for s in SECTIONS if s.recorded}
    return {"format": BASELINE_FORMAT, "reason": reason, "produced_by": _producer(settings.device),
            "model": {"name": model_name or Path(ckpt.path).name, "fingerprint": model_fingerprint(ckpt)},
            "settings": asdict(settings), "top_logprobs": TOP_LOGPROBS,
            "logprob_decimals": LOGPROB_DECIMALS, "prompts": list(PROMPTS[:settings.num_prompts]),
            "sections": sections}


# ---- comparing ---------------------------------------------------------------------------
def _first_difference(want: list[int], got: list[int]) -> int:
    for pos, (a, b) in enumerate(zip(want, got, strict=False)):
        if a != b:
            return pos
    return min(len(want), len(got))


def _logprob_gap(want: list[list[list[float]]], got: list[list[list[float]]]) -> float:
    """Largest |log-prob difference| over the same (position, token); inf if the ids differ."""
    gap = 0.0
    for w_step, g_step in zip(want, got, strict=True):
        if [int(t) for t, _ in w_step] != [int(t) for t, _ in g_step]:
            return float("inf")
        gap = max([gap] + [abs(a - b) for (_, a), (_, b) in zip(w_step, g_step, strict=True)])
    return gap


def _request_mismatch(want: dict[str, Any], got: dict[str, Any], tolerance: float) -> str | None:
    label = f"prompt {want['prompt']} {want['mode']}"
    if want["token_ids"] != got["token_ids"]:
        pos = _first_difference(want["token_ids"], got["token_ids"])
        return f"{label}: tokens differ from position {pos}"
    if want["logprobs"] is None:
        return None
    gap = _logprob_gap(want["logprobs"], got["logprobs"])
    if gap > tolerance:
        return f"{label}: log-probs differ by {gap:.3g} (tolerance {tolerance:g})"
    return None


def compare_section(section: Section, want: list[dict[str, Any]], got: list[dict[str, Any]],
                    tolerance: float) -> SectionResult:
    found = [_request_mismatch(w, g, tolerance) for w, g in zip(want, got, strict=True)]
    mismatches = tuple(m for m in found if m is not None)
    return SectionResult(section.line, len(want) - len(mismatches), len(want), mismatches)


def load(path: str | Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BadInputError(f"cannot read baseline {path}: {exc}", param="against") from exc
    if not isinstance(doc, dict) or doc.get("format") != BASELINE_FORMAT:
        raise BadInputError(f"{path} is not a tf_async baseline ({BASELINE_FORMAT!r})",
                            param="against")
    return doc


def settings_of(doc: dict[str, Any]) -> BaselineSettings:
    return BaselineSettings(**doc["settings"])


def check_model(doc: dict[str, Any], ckpt: Checkpoint, path: str | Path) -> None:
    model = doc["model"]
    if model["fingerprint"] != model_fingerprint(ckpt):
        raise BadInputError(f"baseline {path} was recorded on model {model['name']!r} "
                            f"(fingerprint {model['fingerprint']}), not on {Path(ckpt.path).name!r} "
                            f"(fingerprint {model_fingerprint(ckpt)})", param="model")


async def check(ckpt: Checkpoint, doc: dict[str, Any], path: str | Path = "baseline", *,
                tolerance: float | None = None, tensor_parallel: int = 1) -> list[SectionResult]:
    """Run `doc`'s requests on this build and compare every section (at `tensor_parallel`
    ranks: a TP=N run against a baseline recorded at TP=1, log-probs within `tolerance`)."""
    check_model(doc, ckpt, path)
    settings = settings_of(doc)
    allowed = settings.logprob_tolerance if tolerance is None else tolerance
    results = []
    for section in SECTIONS:
        got = await _run_section(ckpt, settings, section, tensor_parallel)
        want = doc["sections"][section.expected or section.name]["requests"]
        results.append(compare_section(section, want, got, allowed))
    return results


def host_differs(doc: dict[str, Any]) -> str | None:
    """Why this host may compute other bits than the recording one (CPU vector width), or None."""
    recorded = doc["produced_by"]["host"].get("cpu_vector_isa")
    if doc["settings"]["device"] != "cpu" or recorded is None or recorded == cpu_vector_isa():
        return None
    return f"recorded with {recorded} vectors, this host has {cpu_vector_isa()}"


def _section_json(name: str, section: dict[str, Any]) -> str:
    head = {k: v for k, v in section.items() if k != "requests"}
    rows = ",\n".join("    " + json.dumps(r) for r in section["requests"])
    return f'  {json.dumps(name)}: {json.dumps(head)[:-1]}, "requests": [\n{rows}]}}'


def dumps(doc: dict[str, Any]) -> str:
    """JSON with one request a line, so that a regenerated baseline diffs request by request."""
    head = json.dumps({k: v for k, v in doc.items() if k != "sections"}, indent=1)[:-2]
    sections = ",\n".join(_section_json(n, s) for n, s in doc["sections"].items())
    return f'{head},\n "sections": {{\n{sections}\n }}\n}}\n'


def write(doc: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(dumps(doc))
