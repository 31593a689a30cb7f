"""The execution layer (torch): what runs a step's passes and what each pass needs."""
