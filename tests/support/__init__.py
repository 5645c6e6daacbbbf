"""What the tests share, in one place: paths and skip markers (paths), tiny Hugging Face Llama
configs and the transformers oracle (hf), the generate.py helpers (cli), toy models and
independent references (toy_models), hypothesis strategies (strategies), the chi-square harness
and the token-wise verifier's broken variants (statistical), damaged safetensors files (damage),
source-level mutants and the maintained mutation run (mutation), and the ``proof`` marker with
the page docs/proofs.md generated from it (proofs). No tests here."""
