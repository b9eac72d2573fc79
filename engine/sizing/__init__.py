"""How many bytes each device needs: compute buffers, llama.cpp's memory breakdown table, the
estimate from file headers alone (`kvscope estimate`), and the settings that decide the sizes
(context size aliases, the sliding window, the checks that need no model)."""
