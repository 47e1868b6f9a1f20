"""Models outside the engines: the built-in packaged GGUFs and the cache (:mod:`.packaged`), loading
the target/draft pair and deriving drafts (:mod:`.loading`), GGUF conversion for llama.cpp
(:mod:`.gguf_export`)."""
