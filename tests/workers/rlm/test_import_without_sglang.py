"""Choosing the SGLang backend where SGLang is not installed says how to install it. (That everything else imports
and runs without SGLang and its requirements is tests/install/test_minimal_install.py.)"""

import subprocess
import sys


def test_choosing_sglang_without_it_names_the_install():
    # psutil stays: Ray (which the engine path imports) needs it, and brings its own copy
    code = "import sys; sys.modules['sglang'] = None; " + (
        "from workers.agents.clients import make_llm\nfrom workers.models.tiny import ensure_tiny_model\n"
        "try:\n    make_llm('sglang', {'model_name': ensure_tiny_model('nano')})\n"
        "except ImportError as e:\n    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "SGLang is not installed" in r.stdout and "make sglang-cpu" in r.stdout, (
        r.stdout + r.stderr[-2000:]
    )
