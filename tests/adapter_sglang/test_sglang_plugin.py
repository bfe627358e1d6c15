"""The installed ``sglang.srt.plugins`` entry point: SGLang's own ``load_plugins`` registers
``prefixattn`` and its CLI then accepts ``--attention-backend prefixattn``.

Each check runs in a fresh interpreter, as a spawned scheduler process would, so no earlier
import in this test session can register anything on the plugin's behalf.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("sglang")


def _python(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_entry_point_is_installed():
    out = _python(
        """
        from importlib.metadata import entry_points
        eps = entry_points(group="sglang.srt.plugins")
        print(sorted(f"{ep.name}={ep.value}" for ep in eps))
        """
    )
    assert "prefixattn=prefixattn.adapters.sglang.plugin:register" in out


def test_importing_prefixattn_imports_no_sglang():
    out = _python(
        """
        import sys
        import prefixattn, prefixattn.adapters, prefixattn.adapters.sglang.plugin
        print(sorted(m for m in sys.modules if m.split(".")[0] == "sglang"))
        """
    )
    assert out.strip() == "[]"


def test_load_plugins_makes_cli_accept_the_backend():
    out = _python(
        """
        import argparse
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        load_plugins()
        load_plugins()  # SGLang guards repeats; register() itself is idempotent too
        from prefixattn.adapters.sglang.plugin import create_backend, register
        register()
        register()

        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        for flag in ("--attention-backend", "--decode-attention-backend"):
            args = parser.parse_args(["--model-path", "dummy", flag, "prefixattn"])
            print(flag, args.attention_backend, args.decode_attention_backend)
        from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
        print("choices", ATTENTION_BACKEND_CHOICES.count("prefixattn"))
        print("factory", ATTENTION_BACKENDS["prefixattn"] is create_backend)
        """
    )
    assert "--attention-backend prefixattn None" in out
    assert "--decode-attention-backend None prefixattn" in out
    assert "choices 1" in out
    assert "factory True" in out


def test_cli_rejects_the_backend_without_the_plugin():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import argparse
                from sglang.srt.server_args import ServerArgs
                parser = argparse.ArgumentParser()
                ServerArgs.add_cli_args(parser)
                parser.parse_args(["--model-path", "d", "--attention-backend", "prefixattn"])
                """
            ),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "invalid choice" in proc.stderr
