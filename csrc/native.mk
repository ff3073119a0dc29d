# Native core (csrc/): `make native` builds build/native/expertcache_native<EXT_SUFFIX>.so.
# Include from the top-level Makefile; also usable standalone: make -f csrc/native.mk native
#
# Sources: every csrc/src/*.cc and csrc/python/*.cc (g++), and csrc/cuda/*.cu (nvcc) when nvcc is
# found. Optional features, detected here and recorded in build/native/features.mk:
#   io_uring  liburing's header and library present  -> -DEXPERTCACHE_WITH_URING, -luring
#             (otherwise the reader uses its pread thread pool only)
#   ISA-L     libisal's header and library present   -> -DEXPERTCACHE_WITH_ISAL, -lisal
#             (CRC-32 by carry-less multiply; otherwise zlib's crc32, same values)
#   CUDA      nvcc on PATH (or NVCC=...), not disabled with EXPERTCACHE_NO_CUDA=1
#             -> -DEXPERTCACHE_WITH_CUDA, csrc/cuda/*.cu compiled, cudart linked statically so
#                the module loads on machines without a driver (CUDA calls then report an error)
# When the detected features change, everything is rebuilt (objects depend on the flags file).
# Incremental otherwise: objects are rebuilt only when their sources or headers change (-MMD).
PY ?= .venv/bin/python
CXX ?= g++
NATIVE_DIR := build/native
NATIVE_OBJ := $(NATIVE_DIR)/obj
NATIVE_SRCS := $(wildcard csrc/src/*.cc) $(wildcard csrc/python/*.cc)
NATIVE_OBJS := $(patsubst csrc/%.cc,$(NATIVE_OBJ)/%.o,$(NATIVE_SRCS))
# Evaluated lazily (=), and only once, when a compile recipe needs it.
NATIVE_PYINC = $(eval NATIVE_PYINC := $$(shell $(PY) -m pybind11 --includes))$(NATIVE_PYINC)
NATIVE_DEFS :=
NATIVE_INCS := -Icsrc/include
NATIVE_LIBS := -lz

# -- io_uring ------------------------------------------------------------------------------------
NATIVE_HAVE_URING := $(shell echo 'int main(){struct io_uring r; return io_uring_queue_init(1, &r, 0);}' | $(CXX) -x c++ -include liburing.h - -luring -o /dev/null >/dev/null 2>&1 && echo 1)
ifeq ($(NATIVE_HAVE_URING),1)
NATIVE_DEFS += -DEXPERTCACHE_WITH_URING
NATIVE_LIBS += -luring
endif

# -- ISA-L (CRC-32 with carry-less multiply; zlib's table-driven crc32 otherwise) -------------------
NATIVE_HAVE_ISAL := $(shell echo 'int main(){return (int)crc32_gzip_refl(0, 0, 0);}' | $(CXX) -x c++ -include isa-l/crc.h - -lisal -o /dev/null >/dev/null 2>&1 && echo 1)
ifeq ($(NATIVE_HAVE_ISAL),1)
NATIVE_DEFS += -DEXPERTCACHE_WITH_ISAL
NATIVE_LIBS += -lisal
endif

# -- CUDA ------------------------------------------------------------------------------------------
NVCC ?= $(shell command -v nvcc 2>/dev/null)
ifneq ($(EXPERTCACHE_NO_CUDA),1)
ifneq ($(NVCC),)
# nvcc may be a wrapper script: take the first candidate that has the runtime's header.
NATIVE_CUDA_HOME := $(firstword $(foreach d,$(CUDA_HOME) $(abspath $(dir $(NVCC))/..) /usr/local/cuda,$(if $(wildcard $(d)/include/cuda_runtime.h),$(d))))
NATIVE_CU_SRCS := $(wildcard csrc/cuda/*.cu)
NATIVE_CU_OBJS := $(patsubst csrc/%.cu,$(NATIVE_OBJ)/%.cu.o,$(NATIVE_CU_SRCS))
NATIVE_DEFS += -DEXPERTCACHE_WITH_CUDA
NATIVE_INCS += -I$(NATIVE_CUDA_HOME)/include
NATIVE_LIBS += -L$(NATIVE_CUDA_HOME)/lib64 -L$(NATIVE_CUDA_HOME)/lib -lcudart_static -ldl -lrt
endif
endif

NATIVE_CXXFLAGS := -O2 -std=c++17 -fPIC -fvisibility=hidden -pthread -Wall -Wextra $(NATIVE_INCS) $(NATIVE_DEFS)
NATIVE_NVCCFLAGS := -O2 -std=c++17 -Xcompiler -fPIC,-fvisibility=hidden,-Wall $(NATIVE_INCS) $(NATIVE_DEFS)
# The venv may not exist yet when make reads this (a fresh clone): its interpreter is the python3
# it was made from, so that one names the same extension suffix.
NATIVE_EXT := $(shell { $(PY) -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))" || python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"; } 2>/dev/null)
NATIVE_SO := $(NATIVE_DIR)/expertcache_native$(NATIVE_EXT)
NATIVE_FEATURES := $(NATIVE_DIR)/features.mk
NATIVE_FEATURES_TEXT := NATIVE_DEFS=$(strip $(NATIVE_DEFS)) NATIVE_LIBS=$(strip $(NATIVE_LIBS))

.PHONY: native native-features

native: $(NATIVE_SO)

# Rewritten only when the detected features differ from the recorded ones.
$(NATIVE_FEATURES): native-features
	@mkdir -p $(NATIVE_DIR)
	@if [ "$$(cat $@ 2>/dev/null)" != "$(NATIVE_FEATURES_TEXT)" ]; then \
	  echo "$(NATIVE_FEATURES_TEXT)" > $@; echo "native features: $(NATIVE_FEATURES_TEXT)"; fi

$(NATIVE_SO): $(NATIVE_OBJS) $(NATIVE_CU_OBJS) $(NATIVE_FEATURES)
	@test -n "$(NATIVE_EXT)" || { echo "native: cannot run $(PY); run 'make install' first" >&2; exit 1; }
	$(CXX) -shared -pthread -o $@ $(NATIVE_OBJS) $(NATIVE_CU_OBJS) $(NATIVE_LIBS)

$(NATIVE_OBJ)/%.o: csrc/%.cc $(NATIVE_FEATURES)
	@mkdir -p $(dir $@)
	$(CXX) $(NATIVE_CXXFLAGS) $(NATIVE_PYINC) -MMD -MP -c $< -o $@

$(NATIVE_OBJ)/%.cu.o: csrc/%.cu $(NATIVE_FEATURES)
	@mkdir -p $(dir $@)
	$(NVCC) $(NATIVE_NVCCFLAGS) -MMD -MP -c $< -o $@

-include $(NATIVE_OBJS:.o=.d) $(NATIVE_CU_OBJS:.o=.d)
