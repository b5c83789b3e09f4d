"""llmgw: a self-hosted LLM cluster behind one OpenAI-compatible API."""


def __getattr__(name: str) -> str:
    # ``__version__`` is read from the installed package when first asked for, not when
    # the package is imported: importlib.metadata takes about 50 ms to import, and every
    # llmgw process imports this package (each CLI command, each sim engine), most of
    # them never asking.
    if name != "__version__":
        raise AttributeError(f"module 'llmgw' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("llmgw")
    except PackageNotFoundError:  # running from a source tree that was never installed
        found = "0.0.0+unknown"
    globals()["__version__"] = found
    return found
