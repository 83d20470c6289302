"""Mixed precision, memory format and compression settings: resolved for the device, checkpointed, and
on CPUs (where the tests run) a bf16 run that follows the fp32 one. GPU paths are covered by their
configuration and by CPU autocast (the same code, another device type)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_train import events, prepared, run, train_cmd  # noqa: F401  (prepared is a fixture)
from training.checkpoints import load_latest_checkpoint
from training.config import TRAIN_PRESETS, parse_overrides
from training.cpu_features import parse_cpuinfo, this_cpu
from training.evaluate import predict
from training.model import SCNN, SCNNLoss, model_config
from training.precision import MIN_GAIN, Calibration, Device, MixedPrecision, resolve, resolve_compile

H200 = Device("cuda", bf16=True, name="NVIDIA H200")
T4 = Device("cuda", bf16=False, name="Tesla T4")
CPU = Device("cpu", bf16=False, name="AMD EPYC 7763")
CPU_BF16 = Device("cpu", bf16=True, name="Intel Xeon Platinum 8480+")


def never_calibrate(candidates: list) -> Calibration:
    raise AssertionError(f"nothing to calibrate, yet asked to time {candidates}")


def forced(**milliseconds: float):
    """A calibration that answers these step times (``bf16_channels_last=48``...) and records what it was asked."""
    asked: list = []

    def calibrate(candidates: list) -> Calibration:
        asked.append(list(candidates))
        return Calibration({c: milliseconds[f"{c[0]}_{c[1]}"] / 1000 for c in candidates}, "forced by the test")
    calibrate.asked = asked  # type: ignore[attr-defined]
    return calibrate


def test_on_gpus_auto_picks_the_native_half_precision_and_channels_last_without_calibrating() -> None:
    chosen = [resolve("auto", "auto", device, never_calibrate) for device in (H200, T4)]
    assert [(n.precision, n.memory_format) for n in chosen] == [("bf16", "channels_last"), ("fp16", "channels_last")]
    assert "NVIDIA H200" in chosen[0].reason
    assert resolve("fp32", "contiguous", H200, never_calibrate).memory_format == "contiguous"


def test_on_a_cpu_with_native_bf16_auto_takes_the_calibrations_fastest_and_keeps_fp32_where_nothing_pays() -> None:
    fast = forced(fp32_contiguous=100, fp32_channels_last=75, bf16_contiguous=70, bf16_channels_last=48)
    numerics = resolve("auto", "auto", CPU_BF16, fast)
    assert (numerics.precision, numerics.memory_format) == ("bf16", "channels_last")
    assert fast.asked == [[("fp32", "contiguous"), ("bf16", "channels_last")]]  # the plain path, the fast one
    assert numerics.reason.startswith("bf16/channels_last: 2.08x faster a step than fp32/contiguous")
    assert "forced by the test" in numerics.reason
    # A calibration that shows no gain of at least 1.1x keeps the plain path, whatever is marginally faster.
    flat = forced(fp32_contiguous=100, bf16_channels_last=95)
    numerics = resolve("auto", "auto", CPU_BF16, flat)
    assert (numerics.precision, numerics.memory_format) == ("fp32", "contiguous")
    assert "nothing measured at least 1.1x faster" in numerics.reason
    # An explicit setting narrows what is compared, and wins.
    layout_only = forced(bf16_contiguous=70, bf16_channels_last=48)
    assert resolve("bf16", "auto", CPU_BF16, layout_only).memory_format == "channels_last"
    assert layout_only.asked == [[("bf16", "contiguous"), ("bf16", "channels_last")]]
    assert resolve("fp16", "contiguous", CPU_BF16, never_calibrate).precision == "fp16"


def test_on_a_cpu_without_native_bf16_auto_never_tries_bf16() -> None:
    fast = forced(fp32_contiguous=100, fp32_channels_last=80)
    numerics = resolve("auto", "auto", CPU, fast)
    assert (numerics.precision, numerics.memory_format) == ("fp32", "channels_last")
    assert fast.asked == [[("fp32", "contiguous"), ("fp32", "channels_last")]]
    assert "AMD EPYC 7763" in numerics.reason and "would emulate" in numerics.reason
    numerics = resolve("auto", "contiguous", CPU, never_calibrate)
    assert (numerics.precision, numerics.memory_format) == ("fp32", "contiguous")
    assert "has no native bf16" in numerics.reason


# /proc/cpuinfo as each kind of machine writes it (abridged to the lines read).
SAPPHIRE_RAPIDS = """processor	: 0
vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8

processor	: 1
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: fpu sse2 avx2 fma avx512f
"""
ZEN4 = """processor	: 0
vendor_id	: AuthenticAMD
model name	: AMD EPYC 9V74 80-Core Processor
flags		: fpu sse2 avx2 fma avx512f avx512_bf16 avx512_vnni
"""
ZEN3 = """processor	: 0
vendor_id	: AuthenticAMD
model name	: AMD EPYC 7763 64-Core Processor
flags		: fpu sse2 avx2 fma
"""
GRAVITON3 = """processor	: 0
BogoMIPS	: 2100.00
Features	: fp asimd sve bf16 i8mm
CPU implementer	: 0x41
CPU part	: 0xd40
"""
GRAVITON2 = """processor	: 0
Features	: fp asimd atomics
CPU implementer	: 0x41
CPU part	: 0xd0c
"""


def test_native_bf16_is_read_from_the_cpus_flags_on_intel_amd_and_arm() -> None:
    cpus = [parse_cpuinfo(text) for text in (SAPPHIRE_RAPIDS, ZEN4, ZEN3, GRAVITON3, GRAVITON2)]
    assert [cpu.native_bf16 for cpu in cpus] == [("amx_bf16", "avx512_bf16"), ("avx512_bf16",), (), ("bf16",), ()]
    assert cpus[0].model == "Intel(R) Xeon(R) Platinum 8480+" and cpus[0].logical_cpus == 2
    assert cpus[3].model == "arm implementer 0x41 part 0xd40"
    # A machine is known to a calibration cache by its CPU and the flags that pick kernels, nothing else.
    assert cpus[1].key() != cpus[2].key() and cpus[0].key() == parse_cpuinfo(SAPPHIRE_RAPIDS + "\n").key()
    assert Device.of(torch.device("cpu"), cpus[1]).bf16 and not Device.of(torch.device("cpu"), cpus[2]).bf16
    this = this_cpu()
    assert this.logical_cpus >= 1 and this.model


def test_settings_are_checked_and_compile_on_is_refused_with_elastic() -> None:
    assert TRAIN_PRESETS["tusimple"].precision == "auto" and TRAIN_PRESETS["cpu-demo"].precision == "auto"
    assert parse_overrides("cpu-demo", ["precision=bf16", "memory_format=channels_last",
                                        "compression=fp16", "compile=on"]).compile == "on"
    with pytest.raises(ValueError, match="setting 'precision' must be one of auto, fp32, bf16, fp16, got 'fp8'"):
        parse_overrides("cpu-demo", ["precision=fp8"])
    with pytest.raises(ValueError, match="setting 'compression' must be one of none, fp16"):
        parse_overrides("cpu-demo", ["compression=int8"])
    with pytest.raises(ValueError, match="setting 'compile' must be one of auto, on, off, got 'yes'"):
        parse_overrides("cpu-demo", ["compile=yes"])
    with pytest.raises(ValueError, match="'compile=on' cannot be used with elastic=1"):
        parse_overrides("cpu-demo", ["compile=on", "elastic=1"])
    assert resolve_compile("on", "cpu", elastic=False) == (True, "compile=on: set")


def test_compile_auto_on_cpus_is_off_for_the_figures_it_cites() -> None:
    """auto's CPU answer cites a recorded bench run; those figures say the compile never pays back."""
    compiled, why = resolve_compile("auto", "cpu", elastic=False)
    assert compiled is False and why.startswith("compile=auto: off, the compiled step measured slower than eager")
    [cited] = re.findall(r"bench/results/[\w.-]+\.json", why)
    figures = json.loads((Path(__file__).resolve().parents[1] / cited).read_text())
    measured = figures["compile"]
    assert figures["valid"] and measured["pays"] is False and measured["compiled_ms"] > measured["eager_ms"]
    assert f"compiled {measured['compiled_ms']:.0f} ms a step against eager {measured['eager_ms']:.0f} ms after " \
           f"{measured['compile_s']:.0f} s of compiling" in why


def test_a_flow_run_refuses_compile_on_with_elastic_workers() -> None:
    """The flow's parameters refuse what the trainer would: a worker that joins an elastic run would compile for
    minutes while the others wait in their reset."""
    from pydantic import ValidationError

    from flows.params import TrainParams
    from tests.unit_helpers import source

    elastic = {"min_workers": 1, "max_workers": 2}
    with pytest.raises(ValidationError, match="compile='on' cannot be used with elastic: a worker that joins"):
        TrainParams(source=source(), elastic=elastic, compile="on")
    assert TrainParams(source=source(), elastic=elastic, compile="off").compile == "off"
    assert TrainParams(source=source(), elastic=elastic).compile == "auto"
    assert TrainParams(source=source(), compile="on").compile == "on"  # a fixed-size run may compile


def test_the_fp16_loss_scale_is_checkpointed_and_resumed_in_any_precision() -> None:
    fp16 = MixedPrecision("fp16", "cpu")
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # overflowing steps halve the scale; finite ones keep it
        with fp16.autocast():
            loss = model(torch.full((2, 4), 1e4)).float().sum() * 1e30
        optimizer.zero_grad()
        fp16.backward_and_step(loss, optimizer, distributed=False)
    state = fp16.state_dict()
    assert state is not None and state["scale"] < 65536.0
    resumed = MixedPrecision("fp16", "cpu")
    assert resumed.load_state_dict(state) == f"loss scale {state['scale']:g} resumed"
    assert resumed.scaler.get_scale() == state["scale"]
    assert MixedPrecision("bf16", "cpu").state_dict() is None
    assert "dropped" in MixedPrecision("bf16", "cpu").load_state_dict(state)
    assert "fresh scaler" in MixedPrecision("fp16", "cpu").load_state_dict(None)


def test_message_passing_trains_under_autocast() -> None:
    """The custom autograd op computes in autocast's dtype, forward and backward alike."""
    torch.manual_seed(0)
    config = model_config("cpu-demo")
    model = SCNN(config)
    images = torch.randn(2, 3, config.input_height, config.input_width)
    masks = torch.randint(0, 5, (2, config.input_height, config.input_width))
    exist = torch.randint(0, 2, (2, 4)).float()
    grads = {}
    for dtype in (None, torch.bfloat16):
        model.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            logits, existence = model(images)
        loss, _ = SCNNLoss()(logits.float(), existence.float(), masks, exist)
        loss.backward()
        grads[dtype] = model.message_passing[0].weight.grad.clone()
    assert grads[torch.bfloat16].dtype == torch.float32 and torch.isfinite(grads[torch.bfloat16]).all()
    cosine = torch.nn.functional.cosine_similarity(grads[None].flatten(), grads[torch.bfloat16].flatten(), dim=0)
    assert cosine > 0.98


def test_evaluation_scores_fp32_outputs_even_inside_autocast(prepared: Path) -> None:  # noqa: F811
    torch.manual_seed(0)
    config = model_config("cpu-demo")
    model = SCNN(config)
    plain, _ = predict(model, config, prepared, "val", torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside, _ = predict(model, config, prepared, "val", torch.device("cpu"))
    assert [p["lanes"] for p in inside] == [p["lanes"] for p in plain]


def losses(stdout: str) -> np.ndarray:
    return np.array([e["loss"] for e in events(stdout) if e["event"] == "step"])


def test_a_bf16_run_follows_the_fp32_loss_curve_and_checkpoints_cross_precisions(
        prepared: Path, tmp_path: Path) -> None:  # noqa: F811
    steps = ["--set", "max_steps=30", "--set", "epochs=10", "--set", "checkpoint_every=10"]
    fp32 = run(train_cmd(prepared, tmp_path / "fp32", *steps, "--set", "precision=fp32"))
    bf16 = run(train_cmd(prepared, tmp_path / "bf16", *steps, "--set", "precision=bf16"))
    assert fp32.returncode == 0 and bf16.returncode == 0, bf16.stderr[-2000:]
    assert next(e for e in events(bf16.stdout) if e["event"] == "start")["precision"] == "bf16"
    a, b = losses(fp32.stdout), losses(bf16.stdout)
    assert len(a) == len(b) == 30
    # Same data, augmentation and initial weights (the runs are deterministic): bf16's 8-bit mantissa moves
    # each step's loss by a few per cent (batch 2: no averaging). Tolerance: on average within 8 %, no step
    # beyond 20 %, the last ten steps' mean within 10 %; and both learn. (Measured: 3.6 %, 10 %, 4.6 %.)
    relative = np.abs(b - a) / a
    assert relative.mean() < 0.08 and relative.max() < 0.20, np.round(relative, 4)
    assert abs(b[-10:].mean() - a[-10:].mean()) / a[-10:].mean() < 0.10
    assert a[-5:].mean() < a[:5].mean() / 2 and b[-5:].mean() < b[:5].mean() / 2

    # A bf16 checkpoint resumes in fp16 (a fresh loss scale), whose checkpoint resumes in fp32 (dropped).
    more = ["--set", "epochs=10", "--set", "checkpoint_every=10"]
    # Two steps each: a resume, a step in the new precision and the checkpoint at the end are what is tested.
    fp16 = run(train_cmd(prepared, tmp_path / "bf16", *more, "--set", "max_steps=32", "--set", "precision=fp16"))
    assert fp16.returncode == 0, fp16.stderr[-2000:]
    start = next(e for e in events(fp16.stdout) if e["event"] == "start")
    assert (start["step"], start["precision"], start["resumed"]) == (30, "fp16", True)
    assert "has no loss scale (another precision): starting a fresh scaler" in fp16.stderr
    state = load_latest_checkpoint(tmp_path / "bf16")
    assert state["step"] == 32 and state["precision"] == "fp16" and state["scaler"]["scale"] > 0
    back = run(train_cmd(prepared, tmp_path / "bf16", *more, "--set", "max_steps=34", "--set", "precision=fp32"))
    assert back.returncode == 0 and "(the checkpoint's is dropped)" in back.stderr
    assert json.loads((tmp_path / "bf16" / "eval.json").read_text())["images"] == 4


def start_of(stdout: str) -> dict:
    return next(e for e in events(stdout) if e["event"] == "start")


def test_auto_on_this_cpu_is_calibrated_once_cached_and_takes_the_calibrations_answer(
        prepared: Path, tmp_path: Path) -> None:  # noqa: F811
    """The real trainer on this machine. Its calibration is measured once and cached, and the choice follows what it
    measured — whatever a loaded machine measures: the fast path the CPU should have (bf16 + channels-last with
    native bf16, fp32 + channels-last without) when it was at least MIN_GAIN faster a step, fp32/contiguous when not,
    the reason giving the measured gain. The rule itself is then tested on answers forced by rewriting the cache: a
    clear gain takes the fast path, none keeps fp32/contiguous; a damaged cache is measured again."""
    cache = tmp_path / "cache"
    two_steps = ("--set", "max_steps=2", "--set", "epochs=1")
    first = run(train_cmd(prepared, tmp_path / "first", *two_steps), LANEFLOW_CACHE_DIR=str(cache))
    assert first.returncode == 0, first.stderr[-3000:]
    start = start_of(first.stdout)
    assert "calibration measured now, cached in" in start["numerics_reason"] and start["compile"] is False
    [cached] = (cache / "calibration").glob("scnn-*.json")
    record = json.loads(cached.read_text())
    assert record["inputs"]["model"] == "scnn" and record["inputs"]["threads"] == 1  # OMP_NUM_THREADS=1
    fast = "bf16/channels_last" if this_cpu().native_bf16 else "fp32/channels_last"
    assert set(record["seconds_per_step"]) == {"fp32/contiguous", fast}
    measured = record["seconds_per_step"]
    gain = measured["fp32/contiguous"] / measured[fast]
    chosen = f"{start['precision']}/{start['memory_format']}"
    if gain >= MIN_GAIN:  # the measured gain, in the reason the run records
        assert chosen == fast and start["numerics_reason"].startswith(
            f"{fast}: {gain:.2f}x faster a step than fp32/contiguous"), (gain, start)
    else:
        assert chosen == "fp32/contiguous" and f"nothing measured at least {MIN_GAIN}x faster" in \
            start["numerics_reason"], (gain, start)

    def forced_run(name: str, seconds: dict[str, float]) -> dict:
        cached.write_text(json.dumps({**record, "seconds_per_step": seconds}))
        done = run(train_cmd(prepared, tmp_path / name, *two_steps), LANEFLOW_CACHE_DIR=str(cache))
        assert done.returncode == 0, done.stderr[-3000:]
        start = start_of(done.stdout)
        assert f"calibration cached in {cached}" in start["numerics_reason"]
        return start

    # A clear gain (twice as fast): the fast path — bf16 + channels-last on a CPU with native bf16.
    start = forced_run("gain", {"fp32/contiguous": 0.1, fast: 0.05})
    assert f"{start['precision']}/{start['memory_format']}" == fast
    assert start["numerics_reason"].startswith(f"{fast}: 2.00x faster a step than fp32/contiguous")
    # Every candidate as fast as fp32/contiguous: nothing pays, the plain path.
    start = forced_run("flat", dict.fromkeys(record["seconds_per_step"], 0.05))
    assert (start["precision"], start["memory_format"]) == ("fp32", "contiguous")

    cached.write_text("{not json")  # damaged: measured again, the run unaffected
    again = run(train_cmd(prepared, tmp_path / "again", *two_steps), LANEFLOW_CACHE_DIR=str(cache))
    assert again.returncode == 0 and "calibration measured now" in start_of(again.stdout)["numerics_reason"]
    assert json.loads(cached.read_text())["seconds_per_step"]


def test_a_native_bf16_cpu_told_by_laneflow_cpuinfo_takes_bf16_where_its_calibration_pays(
        prepared: Path, tmp_path: Path) -> None:  # noqa: F811
    """auto -> bf16 + channels-last on a CPU with native bf16, on any machine: the trainer reads a Sapphire Rapids'
    /proc/cpuinfo (LANEFLOW_CPUINFO), its calibration compares fp32/contiguous with bf16/channels-last, and with
    the answer forced to a clear gain it trains in bf16 + channels-last."""
    fake = tmp_path / "cpuinfo"
    fake.write_text(SAPPHIRE_RAPIDS)
    cache = tmp_path / "cache"
    two_steps = ("--set", "max_steps=2", "--set", "epochs=1")
    first = run(train_cmd(prepared, tmp_path / "first", *two_steps), LANEFLOW_CACHE_DIR=str(cache),
                LANEFLOW_CPUINFO=str(fake))
    assert first.returncode == 0, first.stderr[-3000:]
    [cached] = (cache / "calibration").glob("scnn-*.json")
    record = json.loads(cached.read_text())
    assert set(record["seconds_per_step"]) == {"fp32/contiguous", "bf16/channels_last"}
    assert record["inputs"]["machine"]["cpu"] == "Intel(R) Xeon(R) Platinum 8480+"
    cached.write_text(json.dumps({**record, "seconds_per_step": {"fp32/contiguous": 0.3, "bf16/channels_last": 0.1}}))
    done = run(train_cmd(prepared, tmp_path / "forced", *two_steps), LANEFLOW_CACHE_DIR=str(cache),
               LANEFLOW_CPUINFO=str(fake))
    assert done.returncode == 0, done.stderr[-3000:]
    start = start_of(done.stdout)
    assert (start["precision"], start["memory_format"]) == ("bf16", "channels_last"), start
    assert start["numerics_reason"].startswith("bf16/channels_last: 3.00x faster a step than fp32/contiguous")


@pytest.mark.parametrize("how", ["LANEFLOW_CPUINFO", "mount namespace"])
def test_on_a_cpu_without_native_bf16_the_trainer_keeps_fp32(how: str, prepared: Path,  # noqa: F811
                                                              tmp_path: Path) -> None:
    """The other vendor's path on any machine: the real trainer told its /proc/cpuinfo is a Zen 3's (AVX2, no bf16
    instructions) resolves auto to fp32 and says why. Both paths run wherever the suite runs, whichever the
    machine's own CPU takes: through ``LANEFLOW_CPUINFO`` (any user), and — where root can — with the file itself
    replaced in a mount namespace, so the default /proc/cpuinfo read is what the trainer sees."""
    fake = tmp_path / "cpuinfo"
    fake.write_text(ZEN3)
    cmd = train_cmd(prepared, tmp_path / "zen3", "--set", "max_steps=2", "--set", "epochs=1")
    if how == "LANEFLOW_CPUINFO":
        done = run(cmd, LANEFLOW_CACHE_DIR=str(tmp_path / "cache"), LANEFLOW_CPUINFO=str(fake))
    else:
        if shutil.which("unshare") is None or os.geteuid() != 0:
            pytest.skip("needs root and unshare to give the trainer another /proc/cpuinfo (LANEFLOW_CPUINFO covers it)")
        bind = f"mount --bind {shlex.quote(str(fake))} /proc/cpuinfo && exec {shlex.join(cmd)}"
        done = run(["unshare", "--mount", "sh", "-c", bind], LANEFLOW_CACHE_DIR=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr[-3000:]
    start = start_of(done.stdout)
    assert start["precision"] == "fp32" and start["memory_format"] in ("contiguous", "channels_last")
    assert "AMD EPYC 7763" in start["numerics_reason"] and "would emulate it" in start["numerics_reason"]
    [cached] = (tmp_path / "cache" / "calibration").glob("scnn-*.json")
    record = json.loads(cached.read_text())
    assert set(record["seconds_per_step"]) == {"fp32/contiguous", "fp32/channels_last"}
    assert record["inputs"]["machine"]["cpu"] == "AMD EPYC 7763 64-Core Processor"


def test_a_cpuinfo_override_that_cannot_be_read_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LANEFLOW_CPUINFO", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"LANEFLOW_CPUINFO=.*missing cannot be read .*or unset it"):
        this_cpu()
    (tmp_path / "zen4").write_text(ZEN4)
    monkeypatch.setenv("LANEFLOW_CPUINFO", str(tmp_path / "zen4"))
    assert this_cpu().model == "AMD EPYC 9V74 80-Core Processor" and this_cpu().native_bf16 == ("avx512_bf16",)


def test_the_input_pipeline_and_message_passing_give_the_same_results_channels_last() -> None:
    """A channels-last batch is normalised straight into that layout, and the network (message passing
    included) computes what it computes on a contiguous one, forward and backward, weights left contiguous."""
    from training.dataset import normalize

    torch.manual_seed(0)
    config = model_config("cpu-demo")
    images = torch.randint(0, 256, (2, config.input_height, config.input_width, 3), dtype=torch.uint8)
    plain, nhwc = normalize(images), normalize(images, torch.channels_last)
    assert nhwc.is_contiguous(memory_format=torch.channels_last) and torch.equal(plain, nhwc)
    model = SCNN(config)
    masks = torch.randint(0, 5, (2, config.input_height, config.input_width))
    exist = torch.randint(0, 2, (2, 4)).float()
    results = []
    for batch in (plain, nhwc):
        model.zero_grad()
        torch.manual_seed(1)  # the same dropout masks
        logits, existence = model(batch)
        loss, _ = SCNNLoss()(logits, existence, masks, exist)
        loss.backward()
        results.append((loss.detach(), model.message_passing[2].weight.grad.clone(),
                        model.backbone[0].weight.grad.clone()))
    assert all(p.is_contiguous() and p.grad.is_contiguous() for p in model.parameters())  # Horovod's requirement
    for contiguous, channels_last in zip(*results, strict=True):  # fp32 in another order: measured 0.2 %
        assert float((channels_last - contiguous).norm() / contiguous.norm()) < 1e-2  # a layout bug: ~100 %


def test_an_elastic_run_fixes_its_numerics_once_and_a_rank_that_joins_reads_them(tmp_path: Path) -> None:
    """Rank 0 decides and records; a rank that joins later (or starts beside it) reads the record instead of
    calibrating while the others wait in their reset; a damaged record is decided again, never trusted."""
    from training.calibration import ELASTIC_CHOICE, elastic_choice
    from training.precision import Numerics

    path = tmp_path / "run" / ELASTIC_CHOICE
    decided = Numerics("bf16", "channels_last", reason="bf16/channels_last: 2.03x faster a step")
    assert elastic_choice(path, lambda: decided, decides=True) == decided

    def never() -> Numerics:
        raise AssertionError("a joining rank calibrated")

    joined = elastic_choice(path, never, decides=False)
    assert (joined.precision, joined.memory_format) == ("bf16", "channels_last")
    assert joined.reason == f"the run's choice ({path}): bf16/channels_last: 2.03x faster a step"
    path.write_text('{"precision": "fp8", "memory_format": "contiguous"}')  # not a choice laneflow makes
    plain = Numerics("fp32", "contiguous", reason="decided again")
    assert elastic_choice(path, lambda: plain, decides=True) == plain
    path.unlink()
    assert elastic_choice(path, lambda: plain, decides=False, wait_s=1.0) == plain  # rank 0 never wrote one
