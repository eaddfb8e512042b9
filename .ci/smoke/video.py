"""The `model` and `video` extras: `hermes --help`, then `hermes` on a tiny checkpoint and a short generated clip
(PyAV writes and decodes it)."""
import fractions
import subprocess
import sys
import tempfile
from pathlib import Path

import av
import numpy as np

from scaffolding.checkpoint import save_tiny_checkpoint

hermes = str(Path(sys.executable).parent / "hermes")
subprocess.run([hermes, "--help"], check=True, stdout=subprocess.DEVNULL)
with tempfile.TemporaryDirectory() as folder:
    checkpoint = save_tiny_checkpoint(Path(folder) / "tiny", "qwen2_5_vl")
    clip = str(Path(folder) / "clip.mp4")
    with av.open(clip, "w") as container:
        out = container.add_stream("mpeg4", rate=4)
        out.width = out.height = 32
        out.pix_fmt = "yuv420p"
        out.time_base = fractions.Fraction(1, 4)
        for index in range(12):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), index * 20, np.uint8), format="rgb24")
            frame.pts = index
            container.mux(out.encode(frame))
        container.mux(out.encode())
    done = subprocess.run([hermes, "--model", checkpoint, "--video", clip, "--question", "what is the person holding ?",
                           "--budget", "32", "--fps", "2", "--chunk-frames", "4"],
                          capture_output=True, text=True, timeout=600)
    print(done.stdout[-2000:], done.stderr[-2000:])
    done.check_returncode()
print("model,video extras: hermes answered")
