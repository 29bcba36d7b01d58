"""serve: the OpenAI-compatible Batch API (`tokenmill serve`).

  store.py    files and batches as JSON objects in object storage (`<output>/_api/`)
  runner.py   each batch a tokenmill job, run by the server's worker in a child process
  app.py      the HTTP API (FastAPI): OpenAI's files and batches endpoints, bearer keys per tenant

Sits above the job layer (a batch is a job) and below the CLI. docs/batch.md documents the API.
"""
