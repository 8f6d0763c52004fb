"""The install a user has after `make demo` has no SGLang and no psutil (SGLang's requirement): the README's RLM
inference import and the native backend must not need them (engines are imported through the registry, on use)."""

import subprocess
import sys

BLOCK = "import sys; sys.modules.update({'psutil': None, 'sglang': None, 'zmq': None}); "


def test_rlm_inference_imports_without_sglang_or_psutil():
    code = BLOCK + (
        "from workers.rlm.inference import RLM; import workers.agents.clients as c; "
        "assert 'sglang' in c.BACKENDS; "
        "assert not [m for m, v in sys.modules.items() if m.startswith('workers.rollout.sglang') and v]"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


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
