"""The README's commands and the examples/ scripts, executed as a user would run them."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys

from tests.test_serve_support import ENV, REPO, free_port, mmserve_left_in, scratch_tmpdir, wait_ready

README = (REPO / "README.md").read_text()


def _block(heading: str) -> list[str]:
    """The lines of the first ```bash block under a README heading."""
    section = README.split(f"## {heading}\n", 1)[1]
    body = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    # comments (the README test's marker) are no commands
    return [line.split("  #")[0].strip() for line in body.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]

def test_readme_shows_exactly_the_two_setup_commands():
    assert _block("Set-up") == ["make serve", "make test"]

def test_make_serve_answers_the_openai_client(tmp_path):
    """`make serve` on the demo models, then examples/openai_client.py against it."""
    port = free_port()
    env = {**ENV, "HOME": str(tmp_path)}  # the demo models build under this HOME's cache
    proc = subprocess.Popen(["make", "serve", f"PORT={port}"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, 300)
        out = tmp_path / "client.png"
        run = subprocess.run([sys.executable, "examples/openai_client.py", "--base-url", f"http://127.0.0.1:{port}/v1",
                              "-o", str(out)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        for family in ("sd", "sdxl", "sd3", "flux"):
            assert f"{family}-demo" in run.stdout
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "video job: completed" in run.stdout, run.stdout
        for line in ("chat:", "image chat:", "embeddings:", "speech:", "transcription:"):
            assert line in run.stdout, run.stdout
        # a realtime voice turn: the random-weight demo LLM samples its reply (temperature 0.8), which is now and then
        # only characters vits-demo's vocabulary does not hold (control bytes, accents) or nothing: then no sound
        voice = re.search(r"voice: (\w+), ([0-9.]+) s of 24 kHz pcm16 audio, transcript (.*)", run.stdout)
        assert voice and voice[1] in ("completed", "incomplete"), run.stdout
        speakable = re.search(r"[A-Za-z0-9]", ast.literal_eval(voice[3]))
        assert float(voice[2]) > 0 or not speakable, run.stdout
        video = subprocess.run([sys.executable, "examples/realtime_video_client.py", "--url",
                                f"ws://127.0.0.1:{port}/v1/realtime/video", "--frames", "4"],
                               cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
        assert video.returncode == 0, video.stderr
        outputs = re.search(r"(\d+) frames out \(seq \[([0-9, ]*)\]\)", video.stdout)
        assert outputs and int(outputs[1]) >= 1, video.stdout  # newer frames may supersede older ones
        seqs = [int(s) for s in outputs[2].split(",")]
        assert seqs == sorted(seqs) and seqs[-1] == 3, video.stdout  # in order; the newest frame is never dropped
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)

def test_python_api_example(tmp_path, sd_path):
    out = tmp_path / "api.png"
    run = subprocess.run([sys.executable, "examples/python_api.py", sd_path, "-o", str(out), "--steps", "2"],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "step 2/2" in run.stdout
    assert out.read_bytes()[:4] == b"\x89PNG"

def test_benchmark_script_prints_ratios(sd_path, tmp_path):
    scratch = scratch_tmpdir(tmp_path)  # the server's config and job store: a temporary directory, gone at the end
    env = {**ENV, "TMPDIR": str(scratch)}
    run = subprocess.run([sys.executable, "examples/bench_images.py", "--checkpoint", sd_path, "--size", "64",
                          "--steps", "2", "--concurrency", "2", "--repeats", "1", "--quiet-wait", "0"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert mmserve_left_in(scratch) == []
    assert re.search(r"latency .* ratio \d+\.\d+x", run.stdout), run.stdout
    assert re.search(r"throughput .* ratio \d+\.\d+x", run.stdout), run.stdout
    assert "denoise batch sizes reached: <=" in run.stdout

def test_llm_benchmark_script_prints_ratios(tmp_path):
    from pipelines.demo import build_demo_model

    checkpoint = str(build_demo_model("llama", tmp_path / "llama"))
    scratch = scratch_tmpdir(tmp_path)  # the server's config and job store: a temporary directory, gone at the end
    env = {**ENV, "TMPDIR": str(scratch)}
    run = subprocess.run([sys.executable, "examples/bench_llm.py", "--checkpoint", checkpoint, "--requests", "3",
                          "--prompt", "16", "--output", "8", "--server-prompt", "16", "--server-output", "8",
                          "--prefix", "64", "--repeats", "1", "--quiet-wait", "0"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert mmserve_left_in(scratch) == []
    assert len(re.findall(r"ratio \d+\.\d+x", run.stdout)) == 5, run.stdout  # engine 2, server 2, TTFT
    assert len(re.findall(r"round 1/1: ", run.stdout)) == 2, run.stdout  # every run is printed

def test_video_benchmark_script_prints_ratios(tmp_path):
    from pipelines.demo import build_demo_model

    checkpoint = str(build_demo_model("wan", tmp_path / "wan"))
    scratch = scratch_tmpdir(tmp_path)  # the server's config and job store: a temporary directory, gone at the end
    env = {**ENV, "TMPDIR": str(scratch)}
    run = subprocess.run([sys.executable, "examples/bench_video.py", "--checkpoint", checkpoint, "--size", "32",
                          "--frames", "5", "--steps", "2", "--requests", "2", "--vae-size", "64", "--vae-frames", "5",
                          "--repeats", "1", "--quiet-wait", "0"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert mmserve_left_in(scratch) == []
    assert re.search(r"throughput .* ratio \d+\.\d+x", run.stdout), run.stdout
    assert re.search(r"vae decode .* ratio \d+\.\d+x", run.stdout), run.stdout
    assert "denoise batch sizes reached: <=" in run.stdout

def test_speed_benchmarks_run_tiny_on_the_cpu(tmp_path):
    """The GPU benchmarks' --tiny modes (tiny demo models, CPU) and the step-cache benchmark print their ratios."""
    runs = {
        "bench_step_cache.py": ["--tiny", "--family", "flux"],
        "bench_kernels.py": ["--tiny"],
        "bench_gpu_llm.py": ["--tiny", "--out", str(tmp_path)],
        "bench_gpu_diffusion.py": ["--tiny", "--out", str(tmp_path), "--models", "sd15",
                                   "--variants", "eager,graphs,cache", "--concurrency", "2", "--repeats", "1"],
    }
    out = {}
    for script, args in runs.items():
        run = subprocess.run([sys.executable, f"examples/{script}", *args], cwd=REPO, env=ENV, capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0, f"{script}\n{run.stderr[-3000:]}"
        out[script] = run.stdout
    assert re.search(r"teacache, threshold=0\.3 +ratio \d+\.\d+x", out["bench_step_cache.py"]), \
        out["bench_step_cache.py"]
    assert len(re.findall(r"ratio \d+\.\d+x", out["bench_kernels.py"])) == 6
    assert re.search(r"batch +4: .* ratio \d+\.\d+x", out["bench_gpu_llm.py"]), out["bench_gpu_llm.py"]
    text = out["bench_gpu_diffusion.py"]
    assert re.search(r"mmserve graphs +\d+\.\d+ s +ratio \d+\.\d+x", text), text
    assert re.search(r"throughput 2 concurrent: .* ratio \d+\.\d+x", text), text
    # the batched-prompt diffusers baseline (one pipeline call with the 2 prompts) is measured and compared
    assert re.search(r"diffusers throughput +\d+\.\d+ img/s \(2 sequential calls\), \d+\.\d+ img/s \(one call with 2 "
                     r"prompts\)", text), text
    assert re.search(r"throughput 2 concurrent: mmserve .* \(one call with 2 prompts\) +ratio \d+\.\d+x", text), text


def test_parallel_benchmark_prints_speed_ups():
    """examples/bench_parallel.py tiny: both modes' runs, speed-ups and per-rank step/collective means."""
    args = ["--repeats", "1", "--steps", "2", "--size", "64"]
    run = subprocess.run([sys.executable, "examples/bench_parallel.py", *args], cwd=REPO, env=ENV, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    for mode in ("cfg", "ulysses"):
        assert re.search(rf"{mode}: 2 ranks x 1 core .* ms, 1 rank x 2 cores .* ms, speed-up \d+\.\d+x", run.stdout), \
            run.stdout
        for rank in (0, 1):
            assert re.search(rf"{mode} rank {rank}: step +\d+\.\d+ ms, collective +\d+\.\d+ ms .*2 forwards",
                             run.stdout), run.stdout
    assert len(re.findall(r"round 1 .*: image +\d+\.\d+ ms", run.stdout)) == 4, run.stdout  # every run is printed


def test_omni_benchmark_prints_the_ratio():
    """examples/bench_omni.py tiny: every run of the three sides, round 1's checks, the throughput ratio and the
    streamed replies' time to first audio."""
    run = subprocess.run([sys.executable, "examples/bench_omni.py", "--requests", "2", "--rounds", "1",
                          "--tokens", "6", "--codes", "72"], cwd=REPO, env=ENV, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    runs = re.findall(r"round 1 (mmserve|transformers|streamed) +2 spoken replies +\d+\.\d+ ms", run.stdout)
    assert len(runs) == 3, run.stdout
    assert re.search(r"round 1: text equal, audio lengths equal, largest waveform difference \S+ \(within 1e-4\)",
                     run.stdout), run.stdout
    assert re.search(r"throughput 2 concurrent: mmserve .* ratio \d+\.\d+x", run.stdout), run.stdout
    assert re.search(r"time to first audio / time to the whole reply, median over [12] requests: \d\.\d\d",
                     run.stdout), run.stdout


def test_lora_benchmark_prints_the_ratios():
    """examples/bench_lora.py --tiny: every run of each side, round 1's equality checks and both ratios."""
    run = subprocess.run([sys.executable, "examples/bench_lora.py", "--tiny"], cwd=REPO, env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(re.findall(r"images round 1 (mixed|grouped|diffusers) +\d+\.\d+ ms", run.stdout)) == 3, run.stdout
    assert len(re.findall(r"llm round 1 (mixed|grouped) +\d+\.\d+ ms", run.stdout)) == 2, run.stdout
    assert "mixed, grouped and diffusers made the same images" in run.stdout, run.stdout
    assert "mixed and grouped made the same tokens" in run.stdout, run.stdout
    assert re.search(r"mixed vs grouped \d+\.\d+x, vs diffusers \d+\.\d+x", run.stdout), run.stdout
    assert "no CUDA device here" in run.stdout or "kernel round 1: both sides agree" in run.stdout, run.stdout


def test_memory_benchmark_prints_its_table():
    """examples/bench_memory.py --tiny: every setting that runs on a CPU, both sides, and the table (CUDA-only
    settings listed as not run)."""
    run = subprocess.run([sys.executable, "examples/bench_memory.py", "--tiny"], cwd=REPO, env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for setting in ("float", "int8wo", "gguf-q8", "gguf-q4", "offload"):
        assert len(re.findall(rf"{setting} +round 1 (mmserve|diffusers) +\d+\.\d+ ms", run.stdout)) == 2, run.stdout
        assert re.search(rf"^{setting} +\d+\.\d+ +-?\d+\.\d+ +\d+\.\d+ +\d+\.\d+ +(inf|\d+\.\d+)$", run.stdout,
                         re.M), run.stdout
    assert re.search(r"^fp8 +not run \(needs a CUDA device\)", run.stdout, re.M), run.stdout


def test_fallback_benchmark_prints_the_overhead():
    """examples/bench_fallback.py --tiny: both sides' runs, the same image, the overhead ratio."""
    run = subprocess.run([sys.executable, "examples/bench_fallback.py", "--tiny"], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(re.findall(r"round 1 (mmserve|__call__) +\d+\.\d+ ms", run.stdout)) == 2, run.stdout
    assert "round 1: both sides made the same image" in run.stdout, run.stdout
    assert re.search(r"overhead \d+\.\d+x", run.stdout), run.stdout
