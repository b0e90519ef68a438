"""Kiln: the OpenAI Responses API for models you host."""
