"""OpenAI's Responses API (``POST /v1/responses``): request.py turns the body into a chat
request, serve.py runs it on the chat path, output.py writes the reply and its events."""
