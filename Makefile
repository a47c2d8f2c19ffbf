# tuna — one flat Makefile.
#   make            build everything into build/ (CUDA parts when nvcc is found; CUDA=0 forces CPU-only)
#   make test       install missing dependencies, build, run every test
#   make bench      build and run the benches
#   make demo       install, build, train a tiny LLaMA on the bundled corpus (scripts/demo.sh)
# SM=90a or SM=80 picks the GPU architecture(s); the default is the visible GPU's, or sm_90a alone without one.

BUILD := build
CXX ?= g++
NVCC ?= /usr/local/cuda/bin/nvcc
JOBS ?= $(shell nproc)

ifeq ($(origin CUDA), undefined)
  CUDA := $(if $(wildcard $(NVCC)),1,0)
endif

CPPFLAGS := -I. -MMD -MP
CXXFLAGS := -std=c++20 -O2 -g -fopenmp -Wall -Wextra -Werror -Wno-unused-parameter
# OpenBLAS's OpenMP build when installed (scripts/install-deps.sh installs it): its GEMMs then run on the same
# OpenMP threads as tuna's own loops. With the pthreads build (Debian's default alternative) two pools of
# spinning threads compete for the cores between a GEMM and the next loop. The rpath keeps that choice
# whatever the system's libopenblas.so.0 alternative points to.
OPENBLAS_OPENMP := /usr/lib/x86_64-linux-gnu/openblas-openmp
comma := ,
BLAS_LIBS := $(if $(wildcard $(OPENBLAS_OPENMP)/libopenblas.so),-L$(OPENBLAS_OPENMP) -Wl$(comma)-rpath$(comma)$(OPENBLAS_OPENMP)) -lopenblas
LDLIBS := $(BLAS_LIBS) -lsentencepiece -lsentencepiece_train -lpcre2-8 -lutf8proc -lzstd -lz -lxxhash -lnettle -lpthread -fopenmp
GTEST_LIBS := -lgtest -lgmock -lpthread
BENCH_LIBS := -lbenchmark -lpthread
# The MPI C API only: Open MPI's C++ bindings do not compile under -Werror.
MPI_CFLAGS := $(shell mpicxx --showme:compile 2>/dev/null) -DOMPI_SKIP_MPICXX=1 -DMPICH_SKIP_MPICXX=1
MPI_LIBS := $(shell mpicxx --showme:link 2>/dev/null)
CPPFLAGS += $(MPI_CFLAGS)
LDLIBS += $(MPI_LIBS)

# Library: everything under these folders except mains.
LIB_DIRS := core comm kernels/cpu data model dist plan ckpt engine
LIB_SRCS := $(wildcard $(LIB_DIRS:%=%/*.cpp))
LIB_OBJS := $(LIB_SRCS:%.cpp=$(BUILD)/obj/%.o)

ifeq ($(CUDA),1)
  # The visible GPU's architecture (compute capability 9.0 -> sm_90a, the H100/H200 kernels' target; 8.0 -> 80);
  # without a GPU (CI, a build machine) sm_90a alone: every CUDA file is still compiled, and checked for
  # spills, once instead of once per architecture. SM="90a 80" builds both (a fat binary for mixed clusters).
  GPU_SM := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')
  SM ?= $(if $(GPU_SM),$(if $(filter 90,$(GPU_SM)),90a,$(GPU_SM)),90a)
  GENCODE := $(foreach s,$(SM),-gencode arch=compute_$(s),code=sm_$(s))
  # -Xfatbin=-compress-all: the device code, 4.5 MB in every binary that links the kernels, compressed (about 4x
  # smaller; the driver decompresses a module as it loads it).
  NVCCFLAGS := -std=c++20 -O2 -g -lineinfo $(GENCODE) -Xcompiler -fopenmp,-Wall,-Wno-unused-parameter \
               -Werror all-warnings -Xptxas -warn-spills,-warn-lmem-usage -Xfatbin=-compress-all -DTUNA_CUDA=1
  CU_SRCS := $(wildcard kernels/*.cu)
  CU_OBJS := $(CU_SRCS:%.cu=$(BUILD)/obj/%.o)
  CU_PTXAS := $(CU_SRCS:%.cu=$(BUILD)/obj/%.ptxas)
  LDLIBS += -L/usr/local/cuda/lib64 -lcudart -lcublasLt -lcublas
  CPPFLAGS += -DTUNA_CUDA=1 -I/usr/local/cuda/include
  # NCCL (comm/comm_nccl.cpp) when its header is found; NCCL=0 leaves it out.
  NCCL ?= $(if $(wildcard /usr/local/cuda/include/nccl.h /usr/include/nccl.h),1,0)
  ifeq ($(NCCL),1)
    CPPFLAGS += -DTUNA_NCCL=1
    LDLIBS += -lnccl
  endif
endif

TOOLS := $(patsubst tools/%.cpp,$(BUILD)/%,$(wildcard tools/*.cpp))
# One GoogleTest binary for everything; tests/mpi/ is a second one with its own main (MPI_Init), which
# tests in the first launch under mpirun.
TEST_SRCS := $(filter-out tests/mpi/% tests/fuzz/%,$(wildcard tests/*.cpp tests/*/*.cpp))
TEST_OBJS := $(TEST_SRCS:%.cpp=$(BUILD)/obj/%.o)
# tests/mpi/*_emulated.cpp run on the host emulator only (build/emulated_gpu_mpi_tests, below).
MPI_TEST_SRCS := $(filter-out tests/mpi/%_emulated.cpp,$(wildcard tests/mpi/*.cpp))
MPI_TESTS := $(if $(MPI_TEST_SRCS),$(BUILD)/mpi_tests)
EMULATED_MPI_TESTS := $(if $(wildcard tests/mpi/*_emulated.cpp),$(BUILD)/emulated_gpu_mpi_tests)
# The GPU tests on the host emulator of tests/kernels/emulator: a third binary, build/emulated_gpu_tests, that
# tests/kernels/test_gpu_emulated.cpp runs. It compiles the GPU tests (the ops' and the GPU model's), the real
# launchers of kernels/*.cu and the library's CUDA code (model/*_gpu*.cpp, engine/*_gpu.cpp, dist/zero_gpu.cpp,
# and engine/device.cpp, which picks the device) with g++ against the emulator's CUDA runtime, so every build has
# it, CPU-only included. cuBLASLt is not emulated: kernels/matmul.cu is replaced by a host test double of its
# contract (matmul_host.cpp), and its test, which would then test the double, is left out (it runs on a GPU only).
EMULATOR_DIR := tests/kernels/emulator
EMULATED_LIB_SRCS := model/llama_gpu.cpp model/llama_gpu_forward.cpp model/llama_gpu_backward.cpp \
                     model/llama_gpu_quantized.cpp model/llama_gpu_lora.cpp engine/engine_gpu.cpp engine/device_gpu.cpp \
                     engine/device.cpp model/decode_gpu.cpp comm/comm_staged.cpp comm/comm_loopback.cpp dist/zero_gpu.cpp \
                     model/fp8_gpu.cpp
emulated_objs = $(addsuffix .o,$(addprefix $(BUILD)/obj/emulated/,$(basename $(1))))
# The emulated device: the emulated runtime's streams, the kernels' launchers, the cuBLASLt double, the emulator's
# walk of a thread's call sites (ptx_sm90.h) and the library's CUDA code.
EMULATED_DEVICE_OBJS := $(call emulated_objs,$(EMULATOR_DIR)/matmul_host.cpp $(EMULATOR_DIR)/runtime.cpp \
                          $(EMULATOR_DIR)/call_site.cpp \
                          $(filter-out kernels/matmul.cu,$(wildcard kernels/*.cu)) $(EMULATED_LIB_SRCS))
EMULATED_OBJS := $(call emulated_objs,$(EMULATOR_DIR)/main.cpp $(wildcard $(EMULATOR_DIR)/test_*.cpp) \
                   $(filter-out tests/kernels/test_matmul_gpu.cpp,$(wildcard tests/kernels/*_gpu.cpp)) \
                   $(filter-out tests/kernels/%,$(wildcard tests/*/*_gpu.cpp))) $(EMULATED_DEVICE_OBJS)
# The rest of the library that the tests reach is plain C++, the same in every build: its own objects. (A
# file of it that comes to include a CUDA header belongs in EMULATED_LIB_SRCS; the link says so, as no CUDA
# library is linked here.)
EMULATED_HOST_OBJS := $(filter-out $(EMULATED_LIB_SRCS:%.cpp=$(BUILD)/obj/%.o) $(BUILD)/obj/ckpt/run_dir.o, \
                        $(filter $(BUILD)/obj/kernels/cpu/% $(BUILD)/obj/core/% $(BUILD)/obj/model/% \
                                 $(BUILD)/obj/ckpt/% $(BUILD)/obj/plan/% $(BUILD)/obj/engine/engine.o \
                                 $(BUILD)/obj/engine/engine_cpu.o $(BUILD)/obj/data/loader.o $(BUILD)/obj/data/shard.o \
                                 $(BUILD)/obj/comm/comm.o $(BUILD)/obj/comm/comm_local.o $(BUILD)/obj/dist/zero.o \
                                 $(BUILD)/obj/dist/pipeline.o $(BUILD)/obj/dist/pipeline_pairs.o,$(LIB_OBJS)))
# bench/*_gpu.cpp need the CUDA runtime: built only with CUDA.
# bench/gpu_benches.cpp is the gpu-check build's one binary of the GPU benches, not a bench of its own.
BENCH_SRCS := $(filter-out bench/gpu_benches.cpp,$(wildcard bench/*.cpp))
ifneq ($(CUDA),1)
  BENCH_SRCS := $(filter-out bench/%_gpu.cpp,$(BENCH_SRCS))
endif
BENCHES := $(patsubst bench/%.cpp,$(BUILD)/%,$(BENCH_SRCS))
DEPS_STAMP := $(BUILD)/.deps-installed

# Objects of tools and benches are not intermediates to delete after linking.
.SECONDARY:
.PHONY: all test bench demo deps clean fuzz
all: $(BUILD)/train $(TOOLS) $(BUILD)/tuna_tests $(MPI_TESTS) $(BUILD)/emulated_gpu_tests $(EMULATED_MPI_TESTS) \
     $(BENCHES) gpu-check-emulated $(CU_PTXAS)

deps: $(DEPS_STAMP)
$(DEPS_STAMP): scripts/install-deps.sh
	@mkdir -p $(BUILD)
	TUNA_BUILD_DIR=$(BUILD) scripts/install-deps.sh
	@touch $@

test: $(DEPS_STAMP)
	$(MAKE) -j$(JOBS) all
	./$(BUILD)/tuna_tests
	$(MAKE) -j$(JOBS) fuzz

bench: $(DEPS_STAMP)
	$(MAKE) -j$(JOBS) all
	@for b in $(BENCHES); do echo "== $$b"; ./$$b || exit 1; done

demo: $(DEPS_STAMP)
	$(MAKE) -j$(JOBS) all
	scripts/demo.sh

$(BUILD)/obj/%.o: %.cpp | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(CPPFLAGS) $(CXXFLAGS) -c $< -o $@

# Each kernel's registers, spills and static shared memory as ptxas reports them (-v), kept beside the object:
# kernels/registers.tsv holds them, and tests/kernels/test_registers.cpp compares the two (no second compile).
# The log's first line is the compiler's version. ptxas's info lines stay out of the build's output.
PTXAS_INFO := '^ptxas info\|^    [0-9]* bytes stack frame'
$(BUILD)/obj/%.o $(BUILD)/obj/%.ptxas: %.cu | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	@$(NVCC) --version | tail -1 >$(BUILD)/obj/$*.ptxas
	$(NVCC) $(CPPFLAGS) $(NVCCFLAGS) -Xptxas -v -c $< -o $(BUILD)/obj/$*.o 2>>$(BUILD)/obj/$*.ptxas || \
	  { sed 1d $(BUILD)/obj/$*.ptxas | grep -v $(PTXAS_INFO) >&2; rm -f $(BUILD)/obj/$*.o $(BUILD)/obj/$*.ptxas; exit 1; }
	@sed 1d $(BUILD)/obj/$*.ptxas | grep -v $(PTXAS_INFO) >&2 || true

# train.cu holds the trainer's main: plain C++ (the kernels live in kernels/*.cu), so g++ compiles it in
# every build; nvcc took 20 s of CPU for it.
$(BUILD)/obj/train.o: train.cu | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(CPPFLAGS) $(CXXFLAGS) -x c++ -c $< -o $@

# Binaries link the library as an archive: each takes only the objects it reaches, and --as-needed then drops
# the shared libraries nothing of those uses, so only the binaries that compute on a GPU load CUDA (build/prepare
# --help peaked at 221 MB resident with cuBLASLt loaded, 6 MB without).
LIB_ARCHIVE := $(BUILD)/libtuna.a
$(LIB_ARCHIVE): $(LIB_OBJS) $(CU_OBJS)
	rm -f $@ && ar rcs $@ $^
LINK_LIBS = -Wl,--as-needed $(LDLIBS) -Wl,--no-as-needed

$(BUILD)/train: $(BUILD)/obj/train.o $(LIB_ARCHIVE)
	$(CXX) $^ -o $@ $(LINK_LIBS)

$(BUILD)/%: $(BUILD)/obj/tools/%.o $(LIB_ARCHIVE)
	$(CXX) $^ -o $@ $(LINK_LIBS)

$(BUILD)/tuna_tests: $(TEST_OBJS) $(LIB_ARCHIVE)
	$(CXX) $^ -o $@ $(GTEST_LIBS) $(LINK_LIBS)

$(BUILD)/mpi_tests: $(MPI_TEST_SRCS:%.cpp=$(BUILD)/obj/%.o) $(LIB_ARCHIVE)
	$(CXX) $^ -o $@ $(GTEST_LIBS) $(LINK_LIBS)

$(BUILD)/bench_%: $(BUILD)/obj/bench/bench_%.o $(LIB_ARCHIVE)
	$(CXX) $^ -o $@ $(BENCH_LIBS) $(LINK_LIBS)

# The emulated build compiles kernels/*.cu and the GPU tests as C++ with -DTUNA_EMULATOR (and -DTUNA_CUDA=1,
# which the GPU tests are behind): shim/ comes first on the include path so that <cuda_bf16.h>,
# <cuda_runtime*.h> and <cublasLt.h> are the emulator's host stand-ins, and nothing of CUDA's or MPI's is on
# it. -Wno-unknown-pragmas: g++ ignores the kernels' `#pragma unroll`. -fno-strict-aliasing: device code
# type-puns through reinterpret_cast (bf16 pairs as words, int4 as 8 bf16), which nvcc honours and g++ at -O2
# would not. The emulated objects live under obj/emulated/, apart from the library's own build of the same
# model/*.cpp (against the real CUDA runtime, or without CUDA); EMULATED_HOST_OBJS are shared.
# The emulator names the instruction a thread executes a warpgroup instruction at by the chain of return
# addresses up its stack (ptx_sm90.h, CallSite): frame pointers kept, and no tail calls, cross-jumping or tail
# merging, which would drop a call site from the chain or fold two call sites into one.
EMULATOR_CPPFLAGS := -DTUNA_EMULATOR -DTUNA_CUDA=1 -I$(EMULATOR_DIR)/shim -I. -MMD -MP
EMULATOR_CXXFLAGS := $(CXXFLAGS) -Wno-unknown-pragmas -fno-strict-aliasing -fno-extern-tls-init \
                     -fno-omit-frame-pointer -fno-optimize-sibling-calls -fno-crossjumping -fno-tree-tail-merge
$(BUILD)/obj/emulated/%.o: %.cpp | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(EMULATOR_CPPFLAGS) $(EMULATOR_CXXFLAGS) -c $< -o $@

$(BUILD)/obj/emulated/%.o: %.cu | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(EMULATOR_CPPFLAGS) $(EMULATOR_CXXFLAGS) -x c++ -c $< -o $@

$(BUILD)/emulated_gpu_tests: $(EMULATED_OBJS) $(EMULATED_HOST_OBJS)
	$(CXX) $^ -o $@ $(GTEST_LIBS) $(BLAS_LIBS) -fopenmp

# build/emulated_gpu_mpi_tests: the CUDA engine's data-parallel code (engine/engine_gpu.cpp at dp > 1) on the
# emulator under mpirun, which tests/kernels/test_gpu_emulated.cpp launches: tests/mpi/*_emulated.cpp with the
# MPI tests' main (tests/mpi/main.cpp: MPI_Init, the world comm) and an MpiComm (comm/comm_mpi.cpp) standing in
# for NCCL as the device comm (device buffers are host memory here). Only those two objects see MPI's headers;
# the emulated ones reach MPI through comm/comm.h. Named *_emulated.cpp, not *_gpu.cpp: neither mpi_tests nor
# the gpu-check build (tests/*/*_gpu.cpp) may pick them up, as on a GPU the device comm must be NCCL.
EMULATED_MPI_TEST_SRCS := $(wildcard tests/mpi/*_emulated.cpp)
$(BUILD)/emulated_gpu_mpi_tests: $(BUILD)/obj/tests/mpi/main.o $(call emulated_objs,$(EMULATED_MPI_TEST_SRCS)) \
                                 $(EMULATED_DEVICE_OBJS) $(EMULATED_HOST_OBJS) $(BUILD)/obj/comm/comm_mpi.o \
                                 $(BUILD)/obj/comm/fault_injection.o
	$(CXX) $^ -o $@ $(GTEST_LIBS) $(BLAS_LIBS) -fopenmp $(MPI_LIBS)

# ---- gpu-check's emulated mode (scripts/gpu-check.sh --emulated, which tests/tools/test_gpu_check.cpp runs in
# every build, CPU-only included): gpu-check-build's bin/ with the stand-ins of tests/gpu_check/ over the
# emulator's builds: the GPU tests (build/emulated_gpu_tests), the GPU benches built on the emulator (they list
# what a filter selects; nothing is timed), build/train and build/plan themselves, the demo corpus tokenized.
EMULATED_CHECK := $(BUILD)/gpu-check-emulated
EMULATED_BENCHES := $(patsubst bench/%.cpp,$(EMULATED_CHECK)/benches/%,$(wildcard bench/*_gpu.cpp))
$(EMULATED_CHECK)/benches/bench_%_gpu: $(BUILD)/obj/emulated/bench/bench_%_gpu.o $(EMULATED_DEVICE_OBJS) $(EMULATED_HOST_OBJS)
	@mkdir -p $(dir $@)
	$(CXX) $^ -o $@ -lbenchmark -lpthread $(BLAS_LIBS) -fopenmp

$(EMULATED_CHECK)/bin/data/train-00000.bin: $(BUILD)/prepare $(wildcard demo/corpus/text/*)
	$(tokenize_demo)

.PHONY: gpu-check-emulated
gpu-check-emulated: $(EMULATED_BENCHES) $(BUILD)/emulated_gpu_tests $(BUILD)/train $(BUILD)/plan \
                    $(EMULATED_CHECK)/bin/data/train-00000.bin
	@mkdir -p $(EMULATED_CHECK)/bin/lib
	ln -sf $(CURDIR)/tests/gpu_check/gpu_tests $(CURDIR)/tests/gpu_check/train $(EMULATED_CHECK)/bin/
	ln -sf $(CURDIR)/$(BUILD)/plan $(EMULATED_CHECK)/bin/plan
	for b in $(notdir $(EMULATED_BENCHES)); do ln -sf $(CURDIR)/tests/gpu_check/bench $(EMULATED_CHECK)/bin/$$b; done

# The demo corpus tokenized beside gpu-check's binaries (the GPU machine has no sentencepiece).
define tokenize_demo
rm -rf $(dir $@)
$(BUILD)/prepare --train-tokenizer --vocab-size 1024 --tokenizer $(dir $@)tokenizer.model \
  --out $(dir $@) --val-fraction 0.05 --quiet demo/corpus/text
endef

# ---- gpu-check build (CUDA only): what scripts/gpu-check.sh runs on a GPU machine that has the CUDA toolkit
# and Python but none of the Debian -dev packages. `make gpu-check-build` links one GPU test binary (main +
# tests/*/*_gpu.cpp) and one binary of the GPU benches (bench/gpu_benches.cpp: each bench_NAME_gpu in bin/ is a
# script running `gpu_benches NAME`) into $(GPU_CHECK)/bin, debug info stripped: the machine takes at most 64 MiB
# of carried files, and each binary carries the device code, the CUDA runtime and the library it reaches
# (tests/tools/test_gpu_check.cpp fails past 48 MB). The library objects go through an archive, so only what the
# tests reach is linked (no MPI, NCCL, sentencepiece). Static: GoogleTest, the reference BLAS (CBLAS for the CPU
# twins; the tests' shapes are small, and OpenBLAS's static archive would add 25 MB) with its gfortran runtime,
# libgomp and the CUDA runtime. Dynamic: cuBLASLt (the toolkit there has it), libstdc++ and glibc (newer there).
# Google Benchmark exists in Debian only as a shared library: copied to bin/lib, found through rpath $ORIGIN/lib.
ifeq ($(CUDA),1)
GPU_CHECK := $(BUILD)/gpu-check
GPU_TEST_OBJS := $(patsubst %.cpp,$(BUILD)/obj/%.o,tests/main.cpp $(wildcard tests/*/*_gpu.cpp))
GPU_BENCH_NAMES := $(patsubst bench/bench_%_gpu.cpp,%,$(wildcard bench/*_gpu.cpp))
GPU_BENCHES := $(GPU_BENCH_NAMES:%=$(GPU_CHECK)/bin/bench_%_gpu)
GPU_ARCHIVE_OBJS := $(LIB_OBJS) $(CU_OBJS)
REFERENCE_BLAS := $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/blas/libblas.a) -lopenblas)
GPU_CHECK_LIBS := -Wl,-Bstatic $(REFERENCE_BLAS) -lgfortran -lquadmath -lgomp -Wl,-Bdynamic \
                  -L/usr/local/cuda/lib64 -lcudart_static -lcublasLt -lpthread -ldl -lrt -lm
.PHONY: gpu-check-build
gpu-check-build: $(GPU_CHECK)/bin/gpu_tests $(GPU_BENCHES) $(GPU_CHECK)/bin/train $(GPU_CHECK)/bin/plan \
                 $(GPU_CHECK)/bin/data/train-00000.bin

$(GPU_CHECK)/libtuna_gpu.a: $(GPU_ARCHIVE_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(GPU_CHECK)/bin/gpu_tests: $(GPU_TEST_OBJS) $(GPU_CHECK)/libtuna_gpu.a
	@mkdir -p $(dir $@)
	$(CXX) $^ -o $@ -Wl,-Bstatic -lgtest -Wl,-Bdynamic $(GPU_CHECK_LIBS)
	strip --strip-debug $@

# Each bench compiled again, keeping its benchmarks under its name (bench/gpu_bench_util.h), for gpu_benches.
$(BUILD)/obj/gpu-check/bench/bench_%_gpu.o: bench/bench_%_gpu.cpp | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(CPPFLAGS) $(CXXFLAGS) -DTUNA_GPU_BENCH_NAME='"$*"' -c $< -o $@

GPU_BENCH_OBJS := $(BUILD)/obj/bench/gpu_benches.o $(GPU_BENCH_NAMES:%=$(BUILD)/obj/gpu-check/bench/bench_%_gpu.o)
$(GPU_CHECK)/bin/gpu_benches: $(GPU_BENCH_OBJS) $(GPU_CHECK)/libtuna_gpu.a
	@mkdir -p $(GPU_CHECK)/bin/lib
	cp -L /usr/lib/x86_64-linux-gnu/libbenchmark.so.1debian $(GPU_CHECK)/bin/lib/
	$(CXX) $^ -o $@ -lbenchmark -Wl,-rpath,'$$ORIGIN/lib' $(GPU_CHECK_LIBS)
	strip --strip-debug $@

$(GPU_CHECK)/bin/bench_%_gpu: $(GPU_CHECK)/bin/gpu_benches
	printf '#!/bin/sh\n# The %s bench of gpu_benches, the GPU benches in one binary (the Makefile).\n' $* >$@
	printf 'exec "$$(dirname "$$0")/gpu_benches" %s "$$@"\n' $* >>$@
	chmod +x $@

# The trainer itself, for gpu-check's end-to-end runs on one GPU: train.cu compiled as the plain C++ it is,
# without NCCL (one rank needs none, and the GPU machine's libnccl may not match this toolkit's); Open MPI's
# shared libraries travel in bin/lib (one rank never initializes MPI, but the binary must load; libmpi's own
# RUNPATH hides bin/lib from its dependencies, so gpu-check.sh puts bin/lib on LD_LIBRARY_PATH); the demo
# corpus is tokenized here into bin/data (the GPU machine has no sentencepiece).
# build/plan, for gpu-check's planned-against-measured rows (plain C++: the planner and the memory plans).
$(GPU_CHECK)/bin/plan: $(BUILD)/obj/tools/plan.o $(GPU_CHECK)/libtuna_gpu.a
	@mkdir -p $(dir $@)
	$(CXX) $^ -o $@ $(GPU_CHECK_LIBS)
	strip --strip-debug $@

$(BUILD)/obj/gpu-check/train.o: train.cu | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(filter-out -DTUNA_NCCL=1,$(CPPFLAGS)) $(CXXFLAGS) -x c++ -c $< -o $@

# The trainer reads the model's tokenizer (to check the shards against it): PCRE2, utf8proc, xxHash and Nettle link statically,
# sentencepiece's shared library travels in bin/lib like Open MPI's.
$(GPU_CHECK)/bin/train: $(BUILD)/obj/gpu-check/train.o $(GPU_CHECK)/libtuna_gpu.a
	@mkdir -p $(GPU_CHECK)/bin/lib
	$(CXX) $^ -o $@ -Wl,-rpath,'$$ORIGIN/lib' -Wl,-Bstatic -lpcre2-8 -lutf8proc -lxxhash -lnettle -Wl,-Bdynamic -lsentencepiece \
	  $(GPU_CHECK_LIBS) -Wl,--as-needed $(MPI_LIBS)
	strip --strip-debug $@
	cp -L $$(ldd $@ | awk '/libmpi|libopen-|libhwloc|libevent|libudev|libsentencepiece/ && $$3 !~ /gpu-check/ {print $$3}') $(GPU_CHECK)/bin/lib/

$(GPU_CHECK)/bin/data/train-00000.bin: $(BUILD)/prepare $(wildcard demo/corpus/text/*)
	$(tokenize_demo)
endif

# ---- make fuzz: every reader of untrusted bytes (safetensors, index.json, config.json, state.json, pieces
# metadata, rank files, manifests, token shards, TOML, checkpoint names, tokenizer files and the model config files
# beside them, prepare's .jsonl/.gz/.zst inputs, run.lock as any file or other thing, a LoRA checkpoint's
# adapter_config.json, base_model.json and adapter file) fed seeded mutations of valid inputs and the regression corpus
# tests/fuzz/corpus under AddressSanitizer and UBSan (tests/fuzz/fuzz_readers.cpp): every case must end in a clean
# error or a valid result. The readers' sources are compiled instrumented into obj/fuzz/ and linked first; what
# else they call (communication, kernels, libsentencepiece) comes uninstrumented. An allocation over 2 GB is a
# failure too: a reader bounds what a few kilobytes of input can make it allocate.
# FUZZ_CASES mutated inputs per reader (300 by default: about 5,000 cases, a minute on 2 cores), FUZZ_SEED picks
# them.
FUZZ_CASES ?= 300
FUZZ_SEED ?= 1
# float-cast-overflow is not part of GCC's "undefined": a double out of an integer's range (a pid of 1e30) converted.
FUZZ_FLAGS := -fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all -fno-omit-frame-pointer
FUZZ_SRCS := tests/fuzz/fuzz_readers.cpp $(addprefix core/,checksum.cpp dtype.cpp error.cpp file.cpp json.cpp memory.cpp \
               options.cpp progress.cpp) ckpt/safetensors.cpp model/config.cpp \
             ckpt/checkpoint.cpp ckpt/tensor_reader.cpp ckpt/checkpoint_writer.cpp ckpt/run_dir.cpp ckpt/peft.cpp \
             model/layout.cpp model/lora.cpp model/optimizer.cpp data/shard.cpp data/loader.cpp \
             $(addprefix data/,tokenizer.cpp tokenizer_json.cpp tiktoken.cpp byte_bpe.cpp bpe_text.cpp unicode.cpp sentencepiece_tokenizer.cpp \
               input.cpp prepare.cpp prepare_output.cpp prepare_reader.cpp prepare_report.cpp clean.cpp dedup.cpp chat_template.cpp)
FUZZ_OBJS := $(FUZZ_SRCS:%.cpp=$(BUILD)/obj/fuzz/%.o)

$(BUILD)/obj/fuzz/%.o: %.cpp | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(CPPFLAGS) $(filter-out -O2,$(CXXFLAGS)) -O1 $(FUZZ_FLAGS) -c $< -o $@

$(BUILD)/fuzz_readers: $(FUZZ_OBJS) $(LIB_ARCHIVE)
	$(CXX) $(FUZZ_FLAGS) $^ -o $@ $(LINK_LIBS)

fuzz: $(BUILD)/fuzz_readers
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:max_allocation_size_mb=2048 UBSAN_OPTIONS=print_stacktrace=1 \
	  ./$(BUILD)/fuzz_readers --cases $(FUZZ_CASES) --seed $(FUZZ_SEED) --corpus tests/fuzz/corpus

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
