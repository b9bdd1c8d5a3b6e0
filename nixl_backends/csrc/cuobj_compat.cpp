// Stand-in for NVIDIA's libcuobjclient.so.1 (the cuObject RDMA client, not
// distributed on PyPI). The NIXL wheels' OBJ plugin links against it only for
// its optional accelerated path; without the library the whole OBJ plugin
// fails to load. This library carries the same SONAME and symbols and always
// reports "not connected", so the plugin runs its plain S3 (AWS SDK) path.
// nixl_backends.s3 loads it RTLD_GLOBAL only when the real library is absent.
#include <cstddef>
#include <sys/types.h>

struct CUObjIOOps;
enum cuObjProto_enum : int {};

class cuObjClient {
 public:
  cuObjClient(CUObjIOOps &ops, cuObjProto_enum proto);
  ~cuObjClient();
  bool isConnected();
  int cuMemObjGetDescriptor(void *ptr, size_t size);
  int cuMemObjPutDescriptor(void *ptr);
  static void *getCtx(const void *handle);
  ssize_t cuObjGet(void *ctx, void *ptr, size_t size, loff_t offset, loff_t buf_offset);
  ssize_t cuObjPut(void *ctx, void *ptr, size_t size, loff_t offset, loff_t buf_offset);
};

cuObjClient::cuObjClient(CUObjIOOps &, cuObjProto_enum) {}
cuObjClient::~cuObjClient() {}
bool cuObjClient::isConnected() { return false; }
int cuObjClient::cuMemObjGetDescriptor(void *, size_t) { return -1; }
int cuObjClient::cuMemObjPutDescriptor(void *) { return -1; }
void *cuObjClient::getCtx(const void *) { return nullptr; }
ssize_t cuObjClient::cuObjGet(void *, void *, size_t, loff_t, loff_t) { return -1; }
ssize_t cuObjClient::cuObjPut(void *, void *, size_t, loff_t, loff_t) { return -1; }
