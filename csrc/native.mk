# Native core (csrc/): `make native` builds build/native/expertcache_native<EXT_SUFFIX>.so.
# Include from the top-level Makefile; also usable standalone: make -f csrc/native.mk native
# Incremental: objects are rebuilt only when their sources or included headers change (-MMD).
PY ?= .venv/bin/python
CXX ?= g++
NATIVE_DIR := build/native
NATIVE_OBJ := $(NATIVE_DIR)/obj
NATIVE_SRCS := csrc/src/slot_table.cc csrc/src/host_pool.cc csrc/python/bindings.cc
NATIVE_OBJS := $(patsubst csrc/%.cc,$(NATIVE_OBJ)/%.o,$(NATIVE_SRCS))
# Evaluated lazily (=), and only once, when a compile recipe needs it.
NATIVE_PYINC = $(eval NATIVE_PYINC := $$(shell $(PY) -m pybind11 --includes))$(NATIVE_PYINC)
NATIVE_CXXFLAGS := -O2 -std=c++17 -fPIC -fvisibility=hidden -pthread -Wall -Wextra -Icsrc/include
# The venv may not exist yet when make reads this (a fresh clone): its interpreter is the python3
# it was made from, so that one names the same extension suffix.
NATIVE_EXT := $(shell { $(PY) -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))" || python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"; } 2>/dev/null)
NATIVE_SO := $(NATIVE_DIR)/expertcache_native$(NATIVE_EXT)

.PHONY: native

native: $(NATIVE_SO)

$(NATIVE_SO): $(NATIVE_OBJS)
	@test -n "$(NATIVE_EXT)" || { echo "native: cannot run $(PY); run 'make install' first" >&2; exit 1; }
	$(CXX) -shared -pthread -o $@ $(NATIVE_OBJS)

$(NATIVE_OBJ)/%.o: csrc/%.cc
	@mkdir -p $(dir $@)
	$(CXX) $(NATIVE_CXXFLAGS) $(NATIVE_PYINC) -MMD -MP -c $< -o $@

-include $(NATIVE_OBJS:.o=.d)
