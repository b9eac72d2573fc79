"""Where each weight, layer and K/V buffer goes: devices (real and virtual), llama.cpp's layer
placement (-ngl, -ts, -nkvo), per-weight overrides (-ot), the virtual devices' ledgers, and a
context's plan of all of these, checked before anything is placed."""
