"""The REST serving layer: FastAPI app (native + OpenAI-compatible API), dispatcher over the
workers, health, metrics and the `instgenie serve` launcher. Pydantic is used only here."""
