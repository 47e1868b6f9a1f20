# Included after every project() of the llama-cpp-python build (scripts/install passes it as
# CMAKE_PROJECT_INCLUDE). llama-cpp-python forces LLAMA_BUILD_COMMON ON for its multimodal library
# (mtmd, LLAVA_BUILD), which draftd does not build; common (llama.cpp's chat parsers, argument
# parsing, downloads, jinja: about 60 of the build's 140 steps) is then neither linked by libllama
# nor shipped in the wheel. A normal variable in llama.cpp's directory scope shadows the forced
# cache entry, so common, cpp-httplib and their install rule are skipped.
if(PROJECT_NAME STREQUAL "llama.cpp" AND NOT LLAVA_BUILD)
  set(LLAMA_BUILD_COMMON OFF)
endif()
