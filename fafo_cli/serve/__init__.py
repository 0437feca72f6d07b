"""`fafo serve`: an OpenAI-compatible HTTP server over one Engine (imported only by that command).

    schema.py    request bodies -> a validated Job, or an ApiError naming the field
    worker.py    the queue and the one thread that runs the engine, Steps handed to the requests' event loop
    responses.py OpenAI's response, chunk and usage shapes from Steps, plus our `fafo` object
    app.py       the Starlette app: routes, API key, body size, CORS, server-sent events, client disconnects
    server.py    binding the address, uvicorn, signals, the request log
"""
