"""One file per HuggingFace architecture: its key table, its config mapping both ways and its refusals, declared
as ``ARCHITECTURES = {"HFClassName": zoo.convert.registry.Architecture(...)}`` and registered by one line in
``zoo.convert.registry``. An architecture whose blocks zoo has reads as its differences from one it resembles
(``mistral.py`` is Llama's pieces with its own refusal). docs/adding-a-model.md is the recipe."""
