"""`nanosched serve`: an OpenAI-compatible HTTP server around the engine (needs the `serve`
extra: fastapi, uvicorn). startup.py loads and checks; worker.py runs the engine thread;
protocol.py validates requests; app.py holds the routes."""
