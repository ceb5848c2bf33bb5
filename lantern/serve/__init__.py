"""`lantern serve`: an HTTP service (Starlette on uvicorn) over the step engine, and its Ray Serve deployment.

Needs the `serve` extra (`pip install 'lantern-decoding[serve]'`); importing this package alone imports none of it.
docs/serving.md says how to run and call it.
"""
