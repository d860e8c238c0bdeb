/* tgmm harness: the same harness as gmm.cu (versions, checks, shapes) for the weight gradient
 * out[g] = lhs[rows of g]^T @ rhs[rows of g]. Build as gmm.cu, with dev/cuda/tgmm.cu. */
#define HARNESS_TGMM 1
#include "gmm.cu"
