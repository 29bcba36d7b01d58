"""serve: the OpenAI-compatible Batch API (`tokenmill serve`).

  store.py    files and batches as JSON objects in object storage (`<output>/_api/`)
  runner.py   each batch a tokenmill job, run by the server's worker in a child process
  validate.py a batch's input file checked while `validating`, as OpenAI checks it
  errors.py   errors in the caller's SDK's shape (OpenAI's, or Anthropic's under /v1/messages/)
  messages.py Anthropic's Message Batches API over the same batches
  access.py   who may call (a key names its tenant) and what a call may send (body caps)
  app.py      the HTTP API (FastAPI): OpenAI's files, batches and models endpoints, keys per tenant
  listen.py   how `tokenmill serve` listens: uvicorn on h11, with a deadline for a request's headers

Sits above the job layer (a batch is a job) and below the CLI. docs/batch.md documents the API.
"""
