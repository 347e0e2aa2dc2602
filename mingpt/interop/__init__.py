"""Other projects' formats: Hugging Face GPT-2 weights in and out, and starting a run from them."""
