"""The API process: uvicorn serving the app, which `inferq api` calls with the settings it
parsed."""

from __future__ import annotations

from producer_api.settings import ApiSettings


def run_api(settings: ApiSettings, log_level: str = "info") -> int:
    """Serve the API in this process until Ctrl-C / SIGTERM."""
    import uvicorn

    from producer_api.app import create_app

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=log_level)
    return 0
