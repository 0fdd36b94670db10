"""The playground's Video tab in a real headless Chromium against a real `mmserve serve`: /v1/videos jobs made
from the page (progress, playback, cancel, delete) and a realtime img2img session from a fake camera over
WS /v1/realtime/video.

The helpers and fixtures (the chromium launch, `watched`: a page that fails the test on a console error, `shots`,
screenshots) are tests/test_playground.py's; `watched` takes this module's `browser` and `server`. Chromium's fake
camera plays a small y4m file this module writes (a square moving over a gradient); `--use-fake-ui-for-media-stream`
grants getUserMedia without asking. The models are the tiny random-weight demos: sd-demo serves realtime img2img,
ltx-demo text- and image-to-video (64x64, few frames), so the whole module stays within a minute on two cores.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import numpy as np
import pytest

try:
    from tests.test_playground import (  # noqa: F401  (shots, watched: fixtures, on this module's browser and server)
        API_KEY,
        AUTH,
        keyed_server,
        launch_chromium,
        record_forms,
        screenshot,
        sent_form,
        shots,
        watched,
    )
    from tests.test_serve_support import png_bytes
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from test_playground import (  # noqa: F401
        API_KEY,
        AUTH,
        keyed_server,
        launch_chromium,
        record_forms,
        screenshot,
        sent_form,
        shots,
        watched,
    )
    from test_serve_support import png_bytes

VIDEO_MODEL = "ltx-demo"  # text-to-video and image-to-video
LIVE_MODEL = "sd-demo"  # realtime img2img
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pipelines.demo import build_demo_model

    root = tmp_path_factory.mktemp("playground-video")
    sd, ltx = build_demo_model("sd", root / "sd"), build_demo_model("ltx", root / "ltx")
    srv = keyed_server(root, f"""
[server]
data_dir = "{root / 'data'}"

[[models]]
name = "{LIVE_MODEL}"
path = "{sd}"

[[models]]
name = "{VIDEO_MODEL}"
path = "{ltx}"
family = "ltx"
[models.video]
default_size = [64, 64]
default_frames = 9
""")
    yield srv
    srv.stop()


def write_y4m(path: Path, width: int = 96, height: int = 96, frames: int = 20) -> Path:
    """A y4m clip for chromium's fake camera: text header, then per frame `FRAME\\n` and the Y, U, V planes (4:2:0)
    of a bright square moving over a gradient, so consecutive frames differ."""
    ramp = np.linspace(40, 200, width, dtype=np.uint8)[None, :].repeat(height, 0)
    chroma = np.full((height // 2, width // 2), 128, np.uint8)
    out = bytearray(f"YUV4MPEG2 W{width} H{height} F10:1 Ip A1:1 C420jpeg\n".encode())
    for i in range(frames):
        luma = ramp.copy()
        x = i * (width - 24) // max(1, frames - 1)
        luma[height // 3:height // 3 + 24, x:x + 24] = 235
        out += b"FRAME\n" + luma.tobytes() + (chroma + 30).tobytes() + (chroma - 20).tobytes()  # bluish
    path.write_bytes(bytes(out))
    return path


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    camera = write_y4m(tmp_path_factory.mktemp("camera") / "camera.y4m")
    with launch_chromium("--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                         f"--use-file-for-fake-video-capture={camera}") as chromium:
        yield chromium


def open_video_tab(page, server) -> None:
    page.goto(f"{server.url}/#video")
    page.wait_for_selector("#video-model option", state="attached")  # the model list has arrived
    page.wait_for_selector("#live-model option", state="attached")


def record_progress(page) -> None:
    """window.progress: every value a job's progress bar showed, in order."""
    page.evaluate("""() => {
        window.progress = [];
        new MutationObserver((changes) => changes.forEach((c) => c.target.matches('.video-job progress')
            && window.progress.push(Number(c.target.value))))
          .observe(document.getElementById('video-jobs'),
                   {subtree: true, attributes: true, attributeFilter: ['value']});
    }""")


def submit_job(page, prompt: str, *, steps: int, frames: int = 9) -> dict | None:
    """Fills the job form and creates the job; the JSON body the page sent (None: a multipart one)."""
    page.select_option("#video-model", VIDEO_MODEL)
    page.fill("#video-prompt", prompt)
    page.select_option("#video-size", "64x64")
    page.fill("#video-frames", str(frames))
    page.fill("#video-steps", str(steps))
    page.fill("#video-seed", "5")
    with page.expect_request("**/v1/videos") as sent:
        page.click("#video-submit")
    return sent.value.post_data_json if "json" in sent.value.headers.get("content-type", "") else None


def test_text_to_video_job_shows_progress_then_plays_and_is_deleted(watched, server):
    page = watched.page
    open_video_tab(page, server)
    record_progress(page)
    body = submit_job(page, "waves rolling onto a beach", steps=60, frames=17)  # a few polls long (~2 s here)
    assert body == {"model": VIDEO_MODEL, "prompt": "waves rolling onto a beach", "size": "64x64", "num_frames": 17,
                    "num_inference_steps": 60, "seed": 5}
    job = page.wait_for_selector(".video-job[data-status=completed]", timeout=60_000)
    video_id = job.get_attribute("data-id")
    seen = page.evaluate("window.progress")
    assert seen[-1] == 100 and any(0 < v < 100 for v in seen), f"no progress shown on the way: {seen}"
    text = job.inner_text()
    assert "64x64" in text and "steps\n60" in text and "waves rolling" in text and "text-to-video" in text
    link = job.query_selector("a.download")
    assert link.get_attribute("href").startswith("blob:") and link.get_attribute("download").endswith(".mp4")
    with page.expect_download() as download:
        link.click()
    assert Path(download.value.path()).read_bytes()[4:8] == b"ftyp"  # an MP4 container
    if job.query_selector("video") is not None:  # this chromium plays H.264: the player got the metadata
        page.wait_for_function("document.querySelector('.video-job video').readyState >= 1")
        assert job.eval_on_selector("video", "v => v.duration") > 0
        assert job.eval_on_selector("video", "v => v.videoWidth") == 64
    else:  # it cannot: the page says so and offers the download
        assert "cannot play" in job.inner_text()
    # A browser without H.264 gets the download link and a note instead of a broken player.
    page.evaluate("HTMLMediaElement.prototype.canPlayType = () => ''")
    submit_job(page, "no player for this one", steps=4)
    note = page.wait_for_selector(".video-note").evaluate_handle("n => n.closest('.video-job')").as_element()
    assert "cannot play" in note.inner_text() and note.query_selector("video") is None
    assert note.query_selector("a.download").get_attribute("href").startswith("blob:")
    # At a phone's width nothing scrolls sideways, with finished jobs in the list.
    page.set_viewport_size(PHONE)
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), "the video tab is too wide"
    # Delete: gone from the list and from the server.
    job.query_selector("button").click()
    page.wait_for_selector(f".video-job[data-id='{video_id}']", state="detached")
    assert httpx.get(f"{server.url}/v1/videos/{video_id}", headers=AUTH, timeout=10).status_code == 404


def test_image_to_video_job_sends_the_image_and_can_be_cancelled(watched, server):
    page = watched.page
    open_video_tab(page, server)
    page.select_option("#video-model", VIDEO_MODEL)
    assert page.is_enabled("#video-image")  # ltx-demo takes a start image
    start = png_bytes(64, 64)
    page.set_input_files("#video-image", files=[{"name": "start.png", "mimeType": "image/png", "buffer": start}])
    record_forms(page)
    submit_job(page, "the same scene, moving", steps=200, frames=17)  # long enough to cancel
    parts = sent_form(page)  # multipart, as OpenAI's videos API takes a file
    assert parts["input_reference"] == start and parts["num_inference_steps"] == b"200"
    job = page.wait_for_selector(".video-job")
    assert "start.png" in job.inner_text()
    page.wait_for_selector(".video-job[data-status=in_progress]")
    page.click(".video-job button")  # Cancel while it runs
    page.wait_for_selector(".video-job[data-status=cancelled]", timeout=30_000)
    assert page.inner_text(".video-job button") == "Delete"
    assert "cancelled" in page.inner_text("#video-status")
    video_id = job.get_attribute("data-id")
    assert httpx.get(f"{server.url}/v1/videos/{video_id}", headers=AUTH, timeout=10).json()["status"] == "cancelled"


def test_realtime_img2img_from_the_camera(watched, server, shots):
    page = watched.page
    open_video_tab(page, server)
    sockets = []
    page.on("websocket", lambda socket: sockets.append(socket))
    page.select_option("#live-model", LIVE_MODEL)
    page.select_option("#live-size", "64x64")
    page.fill("#live-steps", "2")
    page.fill("#live-rate", "10")
    page.click("#live-start")
    submit_job(page, "a lighthouse in a storm", steps=4)  # a job beside the session: the screenshot shows both
    page.wait_for_function("Number(document.getElementById('live-frames').textContent) >= 3", timeout=45_000)
    assert [s.url for s in sockets] == [f"{server.url.replace('http', 'ws')}/v1/realtime/video"]
    assert page.is_disabled("#live-start") and page.is_enabled("#live-stop")
    assert page.evaluate("document.getElementById('live-input').videoWidth") == 96  # the fake camera's frames
    # The output canvas holds a drawn frame at the session's size.
    assert page.eval_on_selector("#live-output", "c => [c.width, c.height]") == [64, 64]
    # The fps readout is a number once two frames have come; the latency is measured too.
    page.wait_for_function("/^\\d+(\\.\\d+)?$/.test(document.getElementById('live-fps').textContent)")
    assert float(page.inner_text("#live-fps")) > 0
    assert re.fullmatch(r"\d+ ms", page.inner_text("#live-latency")), page.inner_text("#live-latency")
    # A strength change goes to the running session, which goes on.
    frames = int(page.inner_text("#live-frames"))
    page.fill("#live-strength", "0.8")  # a range input: fill sets it and fires input and change
    page.wait_for_function(f"Number(document.getElementById('live-frames').textContent) > {frames}")
    assert page.inner_text("#live-strength-value") == "0.8"
    page.wait_for_selector(".video-job[data-status=completed] video")
    screenshot(page, shots, "video")
    page.click("#live-stop")
    assert page.inner_text("#live-status") == "Stopped."
    assert page.is_enabled("#live-start") and page.is_disabled("#live-stop")
    assert page.evaluate("document.getElementById('live-input').srcObject") is None  # the camera is released
