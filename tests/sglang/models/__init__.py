"""Out-of-tree SGLang model package (``SGLANG_EXTERNAL_MODEL_PACKAGE``) for the tests."""
