"""Test helpers that ship with the package: tiny random checkpoints in the exact layouts real
models use, and tiny Hugging Face tokenizers. numpy only; tests add torch on top."""
