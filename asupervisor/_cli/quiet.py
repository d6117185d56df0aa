"""TensorFlow's start-up chatter kept off a command's terminal.

The commands' choice, never the library's: a program that imports asupervisor keeps its
own TensorFlow logging as it set it.
"""

from __future__ import annotations

import os
import sys


def quiet_tensorflow() -> None:
    """Import TensorFlow with its start-up lines silenced: absl prints some before
    ``TF_CPP_MIN_LOG_LEVEL`` applies, and a machine without a GPU reports a failed cuInit
    when devices are first listed."""
    if "tensorflow" in sys.modules:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        import tensorflow

        tensorflow.config.list_physical_devices()
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)
