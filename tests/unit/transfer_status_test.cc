// A transfer's final status: the first completion wins, and a final
// Timeout (a peer that did not answer in time) is reported as
// PeerDisconnected, since Timeout from wait() means the transfer goes on.
#include <gtest/gtest.h>

#include "core/transfer.h"

namespace ferry {
namespace {

TEST(TransferStatus, AFinalTimeoutIsReportedAsPeerDisconnected) {
  Transfer t(7, TransferOp::kWrite, 0x1234);
  EXPECT_EQ(t.status().code(), StatusCode::kInProgress);
  ASSERT_TRUE(t.complete(err::Timeout("peer 1234 did not answer the key request within 10 ms")));
  EXPECT_TRUE(t.finished());
  EXPECT_EQ(t.status().code(), StatusCode::kPeerDisconnected);
  EXPECT_EQ(t.status().message(), "peer 1234 did not answer the key request within 10 ms");
}

TEST(TransferStatus, TheFirstCompletionWins) {
  Transfer t(8, TransferOp::kRead, 0x1234);
  ASSERT_TRUE(t.complete(err::OutOfRange("region 3: [10, +5) outside 12 bytes")));
  EXPECT_FALSE(t.complete(Status::Ok()));
  EXPECT_EQ(t.status().code(), StatusCode::kOutOfRange);
  Transfer ok(9, TransferOp::kWrite, 0x1234);
  ASSERT_TRUE(ok.complete(Status::Ok()));
  EXPECT_TRUE(ok.status().ok());
}

}  // namespace
}  // namespace ferry
